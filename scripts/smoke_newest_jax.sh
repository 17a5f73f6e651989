#!/usr/bin/env bash
# Smoke run on the newest JAX and NumPy that pyproject.toml's ranges admit (scripts/
# smoke_oldest_jax.sh newest), with the newest Flax, optax, Orbax and TensorStore the dev
# ranges admit and their tests. JAX 0.11 and later need Python 3.12 or newer: the first such
# interpreter found runs it (PYTHON to choose one); with none, it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
runs_312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }
if [ -z "${PYTHON:-}" ]; then
  candidates=(python3.14 python3.13 python3.12)
  if command -v pyenv >/dev/null; then
    candidates+=("$(pyenv root)"/versions/3.1[2-9]*/bin/python3)
  fi
  for c in "${candidates[@]}"; do
    if runs_312 "$c"; then PYTHON="$c"; break; fi
  done
fi
if [ -z "${PYTHON:-}" ]; then
  echo "WARNING: no Python 3.12 or newer here: the newest-JAX smoke run is skipped" >&2
  exit 0
fi
dev_range() { sed -n "s/.*\"\($1>=[^\"]*\)\".*/\1/p" pyproject.toml | head -1; }
PYTHON="$PYTHON" SMOKE_VENV="${SMOKE_VENV:-${TMPDIR:-/tmp}/snapshard-jax-newest}" \
  SMOKE_PACKAGES="$(dev_range flax) $(dev_range optax) $(dev_range orbax-checkpoint) $(dev_range tensorstore)" \
  SMOKE_TESTS="tests/test_flax.py tests/test_orbax_import.py" \
  bash scripts/smoke_oldest_jax.sh newest
