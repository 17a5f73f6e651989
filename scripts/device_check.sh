#!/usr/bin/env bash
# The accelerator check: on a machine with an NVIDIA GPU the tests marked `cuda`
# (tests/test_cuda.py), then bench/bench_device.py's one table of snapshard against the floors
# of the same bytes on the device (JAX on the backend it finds: TPU, GPU, else CPU; torch on
# CUDA). Under 9 minutes. --dry-run: the same on the CPU with tiny sizes, under a minute
# (CI runs it; the tests marked `cuda` must skip there).
#
# usage: bash scripts/device_check.sh [--dry-run] [bench/bench_device.py's options]
#
# The interpreter: $SNAPSHARD_PY; else .venv (scripts/setup.sh's); else a python3 that has
# JAX already (a TPU machine's image, which reaches no package registry), with the package
# from src/ and the dependencies it lacks installed under a temp dir from wheels in
# build/device-wheels (copied there beforehand), else the machine's own package index, else
# PyPI; else `scripts/setup.sh dev` makes .venv. Where a TPU or an NVIDIA GPU is found and
# JAX lacks its plugin, `jax[tpu]` or `jax[cuda12]` of the same version is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
budget=0
for a in "$@"; do
  [ "$a" = --dry-run ] && dry=1
  case "$a" in --budget-s*) budget=1 ;; esac
done
site="${TMPDIR:-/tmp}/snapshard-device-site"

# pip_add PYTHON SPEC...: into the venv, or (a system python3) under $site.
pip_add() {
  local py=$1
  shift
  if "$py" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    "$py" -m pip install -q "$@"
    return
  fi
  # Carried wheels are the whole list (no dependencies fetched); an index brings them along.
  local from=()
  if [ -d build/device-wheels ]; then
    from=(--no-index --no-deps --find-links build/device-wheels)
  elif [ -d /opt/pypi/simple ]; then
    from=(--index-url file:///opt/pypi/simple --only-binary=:all:)
  fi
  PIP_CONFIG_FILE=/dev/null "$py" -m pip install --isolated -q --no-compile --no-cache-dir \
    --target "$site" "${from[@]}" "$@"
}

# has PYTHON MODULE: whether the module is importable (without importing it).
has() {
  "$1" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$2') is None)" 2>/dev/null
}

if [ -n "${SNAPSHARD_PY:-}" ]; then
  py=$SNAPSHARD_PY
elif [ -x .venv/bin/python ]; then
  py=.venv/bin/python
elif has python3 jax; then
  py=python3
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site"
  missing=()
  for m in numpy ml_dtypes crc32c xxhash; do has python3 "$m" || missing+=("$m"); done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing under $site: ${missing[*]}" >&2
    pip_add python3 "${missing[@]}"
  fi
else
  bash scripts/setup.sh dev
  py=.venv/bin/python
fi

# The package: src/, or the copy of it that $SNAPSHARD_SRC names (a commit's, for figures of
# that commit), ahead of an installed one.
if [ -n "${SNAPSHARD_SRC:-}" ] || [ "$py" = python3 ]; then
  srcdir=$(cd "${SNAPSHARD_SRC:-src}" && pwd)
  export PYTHONPATH="$srcdir${PYTHONPATH:+:$PYTHONPATH}"
fi

gpu=0
tpu=0
if [ "$dry" = 0 ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
  if compgen -G '/dev/accel*' >/dev/null || compgen -G '/dev/vfio/[0-9]*' >/dev/null \
    || compgen -v TPU_ >/dev/null; then tpu=1; fi
  jaxv=$("$py" -c 'import importlib.metadata as m; print(m.version("jax"))')
  for want in "$tpu tpu libtpu" "$gpu cuda12 jax_cuda12_plugin"; do
    read -r on extra module <<<"$want"
    if [ "$on" = 1 ] && ! has "$py" "$module"; then
      pip_add "$py" "jax[$extra]==$jaxv" \
        || echo "WARNING: jax[$extra] did not install: JAX may not see the device" >&2
    fi
  done
fi
echo "python $("$py" -c 'import sys, snapshard; print(sys.version.split()[0], snapshard.__file__)');" \
  "gpu=$gpu tpu=$tpu" >&2

if [ "$dry" = 1 ] || [ "$gpu" = 1 ]; then
  # JAX may pick the GPU here (the tests' conftest pins the CPU only where JAX_PLATFORMS is
  # unset); no preallocation, so that torch's tests in the same process have memory.
  if [ "$dry" = 1 ]; then
    JAX_PLATFORMS=cpu "$py" -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda.py
  else
    JAX_PLATFORMS= XLA_PYTHON_CLIENT_PREALLOCATE=false "$py" -m pytest -q -m cuda
  fi
fi

# The bench's time: what is left of 7 minutes, unless given (a round under way may overrun it
# a little; a job is stopped a minute after it).
extra=()
if [ "$dry" = 0 ] && [ "$budget" = 0 ]; then
  left=$((420 - SECONDS))
  extra=(--budget-s "$((left > 60 ? left : 60))")
fi
"$py" bench/bench_device.py "$@" "${extra[@]}"
echo "device_check: ${SECONDS} s" >&2
