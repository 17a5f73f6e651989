#!/usr/bin/env bash
# Smoke run on the oldest supported JAX: a separate virtual environment with that JAX and
# the oldest NumPy of pyproject.toml's range, snapshard installed from this checkout, a few
# test files. Needs only PyPI (binary wheels; nothing is built from source).
#   bash scripts/smoke_oldest_jax.sh            # the floors of pyproject.toml's jax and numpy ranges
#   bash scripts/smoke_oldest_jax.sh 0.7.2      # another JAX version
#   bash scripts/smoke_oldest_jax.sh newest     # the newest JAX and NumPy the ranges admit
# Environment: SMOKE_VENV (where the environment goes; reused when it exists), PYTHON (the
# interpreter to create it with), SMOKE_NUMPY (a NumPy requirement, e.g. "numpy>=2,<2.3"),
# SMOKE_PACKAGES and SMOKE_TESTS (more requirements, and the test files they serve).
set -euo pipefail
cd "$(dirname "$0")/.."
floor() { sed -n "s/.*\"$1>=\([0-9.]*\),.*/\1/p" pyproject.toml | head -1; }
range() { sed -n "s/.*\"\($1>=[^\"]*\)\".*/\1/p" pyproject.toml | head -1; }
JAX_VERSION="${1:-$(floor jax)}"
if [ "$JAX_VERSION" = newest ]; then
  JAX_REQ="jax[cpu]$(range jax | sed 's/^jax//')"
  NUMPY_REQ="${SMOKE_NUMPY:-$(range numpy)}"
else
  JAX_REQ="jax[cpu]==$JAX_VERSION"
  NUMPY_REQ="${SMOKE_NUMPY:-numpy==$(floor numpy).*}"
fi
VENV="${SMOKE_VENV:-${TMPDIR:-/tmp}/snapshard-jax-$JAX_VERSION}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
# One resolution for JAX, NumPy and the test tools, so that the pins hold together.
"${pip[@]}" --only-binary=:all: "$JAX_REQ" "$NUMPY_REQ" \
  "crc32c>=2.4,<3" "ml_dtypes>=0.5,<0.7" "xxhash>=3.4,<5" \
  "pytest>=8,<10" "pytest-timeout>=2.3,<3" "hypothesis>=6.100,<7" "psutil>=5.9,<8" "tqdm>=4.66,<5" \
  ${SMOKE_PACKAGES:-}
"${pip[@]}" --no-deps -e .
"$VENV/bin/python" -c "import jax, numpy; print('jax', jax.__version__, 'numpy', numpy.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_roundtrip.py tests/test_async_save.py tests/test_resume.py tests/test_mesh_context.py \
  tests/test_cli.py tests/test_jax_transfer.py -k "not orbax and not safetensors"
if [ -n "${SMOKE_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider $SMOKE_TESTS
fi
