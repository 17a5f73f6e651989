#!/usr/bin/env bash
# Set everything up on a fresh machine and run the demo (8 simulated CPU devices).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh jax,cli
.venv/bin/python examples/demo.py "$@"
