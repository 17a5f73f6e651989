#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/python -m ruff check src tests bench examples
.venv/bin/python -m ruff format --check src tests bench examples
.venv/bin/python -m mypy
# Two worker processes (pytest-xdist): much of the suite waits on the processes its
# multi-process tests start. worksteal keeps a module's tests together where it can and
# moves tests from the end of the busier worker's queue to an idle one. `-n 0` runs serially.
.venv/bin/python -m pytest -q -n 2 --dist worksteal "$@"
