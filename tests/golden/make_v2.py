"""Write a golden corpus of on-disk format 2.x into tests/golden/<version>/.

Run it from the repository root with the library of that version:

    PYTHONPATH=src python tests/golden/make_v2.py --out tests/golden/v2_0   # refuses to replace
    PYTHONPATH=src python tests/golden/make_v2.py --out tests/golden/v2_1 --force

It writes, from the trees of `values.py`, with one process of 8 CPU devices:

- `single/`: the full tree (`values.single_tree`), with content hashes;
- `compressed/`: the full tree under `SaveOptions(compression="zstd+shuffle")`;
- `incremental/base/` and `incremental/step/`: `single_tree` saved with content hashes,
  then `values.incremental_tree` saved with `base=` that checkpoint (most chunks are
  references to the base's files).

A corpus written once is never rewritten by a later version of the format: its files are
the reference that later versions must read bit-exactly (tests/test_golden_v2.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def write_all(out: Path) -> None:
    import snapshard
    from golden import values

    m = values.mesh()
    snapshard.save(
        out / "single", values.single_tree(m), options=snapshard.SaveOptions(hashes=True)
    )
    snapshard.save(
        out / "compressed",
        values.single_tree(m),
        options=snapshard.SaveOptions(compression="zstd+shuffle"),
    )
    base = out / "incremental" / "base"
    snapshard.save(base, values.single_tree(m), options=snapshard.SaveOptions(hashes=True))
    snapshard.save(out / "incremental" / "step", values.incremental_tree(m), base=base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="e.g. tests/golden/v2_1")
    ap.add_argument("--force", action="store_true", help="replace an existing corpus")
    args = ap.parse_args()

    import snapshard

    if args.out.exists() and not args.force:
        sys.exit(f"{args.out} exists: the golden corpus is not rewritten without --force")
    tmp = Path(tempfile.mkdtemp(prefix="golden-v2-", dir=args.out.parent))
    try:
        write_all(tmp)
        if args.out.exists():
            shutil.rmtree(args.out)
        tmp.rename(args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} with snapshard {snapshard.__version__}: {total} bytes")


if __name__ == "__main__":
    main()
