"""Multi-process worker: save a sharded tree, or restore it onto this job's topology.

usage: save_restore.py save CKPT [--kill-in-write PID] [--fail-in-write PID]
                          [--kill-before-commit PID] [--timeout S]
       save_restore.py restore CKPT MESH_ROWS SPEC
       save_restore.py restores MESH_ROWS SPEC CKPT...   each CKPT restored in turn in one
                          job, reported with "case": CKPT
   CKPT: a directory or an object-store URL (s3://…); object stores report request counts.
   MESH_ROWS: rows of the restore mesh (data axis); SPEC: 'rows' (P('model', None)),
   'cols' (P(None, 'model')) or 'flat' (1-D mesh, P('x')).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from _dist import init, report

from snapshard import SaveOptions


def storage_for(location):
    from snapshard.storage import storage_for as make

    return make(location)


def requests(storage):
    """Request counts of an object store (None for a local directory)."""
    stats = getattr(storage, "stats", None)
    return stats.as_dict() if stats is not None else None


def global_arrays():
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(1234)
    return {
        "w": rng.standard_normal((1024, 512), dtype=np.float32),
        "e": rng.standard_normal((512, 256), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal((512,), dtype=np.float32),
        "odd": rng.standard_normal((7, 5), dtype=np.float32),
        "host": np.arange(10, dtype=np.int64),
    }


def save(args) -> None:
    pid, _n = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    from snapshard.storage import local_files

    g = global_arrays()
    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(2, -1), ("data", "model"))

    def put(x, *spec):
        s = NamedSharding(mesh, P(*spec))
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    keys = jax.random.split(jax.random.key(42), len(devs))
    tree = {
        "params": {
            "w": put(g["w"], None, "model"),
            "e": put(g["e"], "data", "model"),
            "b": put(g["b"]),
        },
        "odd": put(g["odd"]),
        "host": g["host"],
        "keys": jax.jit(lambda k: k, out_shardings=NamedSharding(mesh, P(("data", "model"))))(keys),
        "step": 17,
    }
    if args.kill_in_write == pid:

        def write(self, data):
            os.kill(os.getpid(), signal.SIGKILL)

        local_files.LocalFileWriter.write = write
    if args.fail_in_write == pid:  # the first data write below the storage layer fails
        import pytest

        from faultinject import FaultInjector

        injector = FaultInjector().install(pytest.MonkeyPatch())
        injector.arm("s3.put_file" if "://" in args.ckpt else "write", 0)
    if args.kill_before_commit == pid:
        from snapshard.storage import objstore

        def die(self):
            os.kill(os.getpid(), signal.SIGKILL)

        objstore.ObjectStorage._write_marker = die  # after the manifest, before the marker
    storage = storage_for(args.ckpt)
    try:
        t = snapshard.save(
            storage, tree, options=SaveOptions(timeout_s=args.timeout, mode=args.mode)
        )
    except Exception as e:
        report(ok=False, error=f"{type(e).__name__}: {e}")
        if pid == 0:
            # Process 0 hosts the coordination service: give the others time to read the
            # outcome before it goes (when it vanishes, JAX's client aborts them).
            time.sleep(3)
        # Skip jax.distributed's shutdown barrier: with a dead peer it would abort.
        os._exit(3)
    report(ok=True, bytes_written=t.bytes_written, timings=t.as_dict(), requests=requests(storage))


def restore(args) -> None:
    init()
    report(**restored(args.ckpt, args.rows, args.spec))


def restores(rows: int, spec: str, ckpts: list[str]) -> None:
    init()
    for ckpt in ckpts:
        report(case=ckpt, **restored(ckpt, rows, spec))


def restored(ckpt: str, rows: int, spec: str) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    g = global_arrays()
    devs = np.array(jax.devices())
    if spec == "flat":
        mesh = Mesh(devs, ("x",))
        big = P("x")
    else:
        mesh = Mesh(devs.reshape(rows, -1), ("data", "model"))
        big = P("model", None) if spec == "rows" else P(None, "model")

    def sds(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    keys = jax.random.split(jax.random.key(42), 8)
    target = {
        "params": {"w": sds(g["w"], big), "e": sds(g["e"], big), "b": sds(g["b"], P())},
        "odd": sds(g["odd"], P()),
        "host": np.zeros(10, np.int64),
        "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(mesh, P())),
        "step": 0,
    }
    stats = snapshard.ReadStats()
    storage = storage_for(ckpt)
    out = snapshard.load(storage, target, stats=stats)
    ok = True
    for name, x in (
        ("w", out["params"]["w"]),
        ("e", out["params"]["e"]),
        ("b", out["params"]["b"]),
        ("odd", out["odd"]),
    ):
        ref = g[name]
        for s in x.addressable_shards:
            ok &= np.asarray(s.data).tobytes() == ref[s.index].tobytes()
    ok &= out["host"].tolist() == list(range(10)) and out["step"] == 17
    ok &= bool(np.array_equal(jax.random.key_data(out["keys"]), jax.random.key_data(keys)))
    return dict(ok=bool(ok), stats=stats.as_dict(), devices=len(devs), requests=requests(storage))


def main() -> None:
    import sys

    if sys.argv[1] == "restores":
        restores(int(sys.argv[2]), sys.argv[3], sys.argv[4:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=["save", "restore"])
    ap.add_argument("ckpt")
    ap.add_argument("rows", nargs="?", type=int, default=1)
    ap.add_argument("spec", nargs="?", default="rows")
    ap.add_argument("--kill-in-write", type=int, default=-1)
    ap.add_argument("--fail-in-write", type=int, default=-1)
    ap.add_argument("--kill-before-commit", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--mode", default="auto")
    args = ap.parse_args()
    save(args) if args.op == "save" else restore(args)


if __name__ == "__main__":
    main()
