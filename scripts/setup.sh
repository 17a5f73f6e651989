#!/usr/bin/env bash
# Create .venv (if missing) and install snapshard with the given extras (default: dev).
# Usage: bash scripts/setup.sh [extras]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[${extras}]"
if [[ ",${extras}," == *,dev,* ]]; then
  # torchtitan for its tests: what its checkpointer, config and optimizers import, then the
  # package itself without its training-data and logging stack (datasets, wandb, tensorboard,
  # ...). The `torchtitan` extra installs it whole. Last and without dependencies, so pip has
  # no missing dependency of it to report.
  .venv/bin/python -m pip install --quiet "tyro>=0.9,<2" "spmd_types==0.2.3" "torchdata>=0.8,<0.12"
  .venv/bin/python -m pip install --quiet --no-deps "torchtitan==0.3.0"
fi
