"""Write the golden corpus of on-disk format v1 into tests/golden/v1/.

Run it with the format-v1 library (the `src/` of the commit that introduced the corpus),
from the repository root:

    PYTHONPATH=src python tests/golden/make_v1.py            # refuses to replace v1/
    PYTHONPATH=src python tests/golden/make_v1.py --force    # rewrites it

It writes, from the trees of `values.py`:

- `single/`: one process with 8 CPU devices, the full tree (`values.single_tree`);
- `multiprocess/`: two real processes joined by jax.distributed (2 x 4 CPU devices, gloo
  collectives, started as tests/multiproc.py starts its workers), with sharded arrays that
  span both processes (`values.multiprocess_tree`);
- `manager/`: a CheckpointManager root with steps 100 and 200 and their metrics;
- `objstore/`: the full tree saved to a memory:// object store, every object downloaded
  under its object name, the empty `COMMITTED` marker included.

Once a later format replaces v1, this script is not run again: the files it wrote are the
reference every later version must read bit-exactly (tests/test_golden_v1.py).
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

OBJSTORE_URL = "memory://golden-v1/run/ckpt"


def write_single(out: Path) -> None:
    import snapshard
    from golden import values

    snapshard.save(out / "single", values.single_tree(values.mesh()))


def write_multiprocess(out: Path) -> None:
    """Start two processes of 4 CPU devices each running this script's worker."""
    import multiproc

    procs = multiproc.run(
        str(Path(__file__).resolve()), 2, 4, "--worker", out / "multiprocess", timeout=180
    )
    for p in procs:
        assert p.result().get("ok"), f"process {p.process_id}: {p.stderr[-3000:]}"


def multiprocess_worker(directory: str) -> None:
    from workers._dist import init, report

    pid, n = init()
    import jax

    import snapshard
    from golden import values

    assert n == 2 and len(jax.devices()) == 8, (n, len(jax.devices()))
    m = values.mesh()
    tree = values.multiprocess_tree(m)
    for x in tree["sharded"].values():  # every sharded array spans both processes
        assert {d.process_index for d in x.sharding.device_set} == {0, 1}
    snapshard.save(directory, tree)
    report(ok=True, process=pid)


def write_manager(out: Path) -> None:
    import snapshard
    from golden import values

    with snapshard.CheckpointManager(out / "manager", async_save=False) as mgr:
        for step in values.MANAGER_STEPS:
            mgr.save(
                step, values.manager_tree(step), metrics=values.manager_metrics(step), force=True
            )
        assert mgr.all_steps() == list(values.MANAGER_STEPS)


def write_objstore(out: Path) -> None:
    import snapshard
    from golden import values
    from snapshard.storage.objstore import COMMIT_MARKER, ObjectStorage

    snapshard.save(OBJSTORE_URL, values.single_tree(values.mesh()))
    storage = ObjectStorage(OBJSTORE_URL)
    names = storage.client.listing()
    assert COMMIT_MARKER in names and "manifest.json" in names, names
    for name in sorted(names):
        data = storage.client.get(name)
        assert data is not None and len(data) == names[name], name
        dest = out / "objstore" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
    storage.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=HERE / "v1", help="default: tests/golden/v1")
    ap.add_argument("--force", action="store_true", help="replace an existing corpus")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one multi-process writer
    args = ap.parse_args()
    if args.worker:
        multiprocess_worker(args.worker)
        return

    import snapshard

    if args.out.exists() and not args.force:
        sys.exit(f"{args.out} exists: the golden corpus is not rewritten without --force")
    tmp = Path(tempfile.mkdtemp(prefix="golden-v1-", dir=args.out.parent))
    try:
        write_single(tmp)
        write_multiprocess(tmp)
        write_manager(tmp)
        write_objstore(tmp)
        if args.out.exists():
            shutil.rmtree(args.out)
        tmp.rename(args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"wrote {args.out} with snapshard {snapshard.__version__}: {total} bytes")


if __name__ == "__main__":
    main()
