#!/usr/bin/env bash
# Build the wheel, install it into a fresh virtual environment outside the source tree, and
# run `snapshard --help` and the demo from there: what a user gets from `pip install`.
# Needs .venv from scripts/setup.sh (dev extras: `build`).
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m build --wheel --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { cat "$work/build.log"; exit 1; }
wheel="$(ls "$work"/dist/snapshard-*.whl)"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "${wheel}[jax,cli]"
cp examples/demo.py "$work/demo.py"
cd "$work"  # nothing of the source tree on the path
"$work/venv/bin/python" -c "import snapshard, sys; assert 'site-packages' in snapshard.__file__, snapshard.__file__"
"$work/venv/bin/python" -m zipfile -l "$wheel" | grep -q "LICENSE" || { echo "the wheel has no LICENSE"; exit 1; }
"$work/venv/bin/snapshard" --help >/dev/null
"$work/venv/bin/python" demo.py --dir "$work/ckpt" --steps 10 --every 5
echo "wheel check: $(basename "$wheel") installs, runs the CLI and the demo"
