#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/python -m ruff check src tests bench examples
.venv/bin/python -m mypy
.venv/bin/python -m pytest -q "$@"
