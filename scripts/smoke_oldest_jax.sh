#!/usr/bin/env bash
# Smoke run on the oldest supported JAX: a separate virtual environment with that JAX (and
# the oldest NumPy it works with), snapshard installed from this checkout, a few test files.
#   bash scripts/smoke_oldest_jax.sh            # the floor of pyproject.toml's jax range
#   bash scripts/smoke_oldest_jax.sh 0.7.2      # another version
set -euo pipefail
cd "$(dirname "$0")/.."
JAX_VERSION="${1:-$(sed -n 's/.*"jax>=\([0-9.]*\),.*/\1/p' pyproject.toml | head -1)}"
VENV="${SMOKE_VENV:-${TMPDIR:-/tmp}/snapshard-jax-$JAX_VERSION}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "jax[cpu]==$JAX_VERSION"
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q "crc32c>=2.4,<3" "ml_dtypes>=0.5,<0.7" \
  "pytest>=8,<10" "pytest-timeout>=2.3,<3" "hypothesis>=6.100,<7" "psutil>=5.9,<8" "tqdm>=4.66,<5"
"$VENV/bin/python" -c "import jax; print('jax', jax.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_roundtrip.py tests/test_async_save.py tests/test_resume.py tests/test_mesh_context.py \
  tests/test_cli.py -k "not orbax and not safetensors"
