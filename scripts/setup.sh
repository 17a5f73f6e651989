#!/usr/bin/env bash
# Create .venv (if missing) and install snapshard with the given extras (default: dev).
# Usage: bash scripts/setup.sh [extras]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[${extras}]"
