"""Multi-process worker for read-once restores.

usage: read_once.py save CKPT
       read_once.py restore CKPT LAYOUT [--no-read-once | --default] [--fail-read PID] [--timeout S]
                    [--safetensors] [--manager] [--budget BYTES]
       read_once.py restores CKPT CASE...   one restore after the other in one job, each CASE
                    the arguments of a restore after CKPT ("rep2 --no-read-once"); each
                    process reports each one with "case": CASE
   LAYOUT: 'rep4' (mesh data=processes x model=devices, params on P(None, 'model'): each box
   on every process), 'rep2' (mesh 2 x (devices*processes/2): each box on 2 processes),
   'cols' (mesh 1 x every device: the arrays' columns cut finer than they were saved, no
   box on two processes).
   Reports, per process, whether every addressable shard matches bit for bit, its ReadStats,
   the unique bytes of the target's array leaves, and the time the load took.
"""

from __future__ import annotations

import argparse
import time

from _dist import exit_after_failure, init, report


def global_arrays():
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((512, 256), dtype=np.float32),
        "e": rng.standard_normal((256, 128), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal((64,), dtype=np.float32),
        "i": rng.integers(0, 1 << 30, (32, 8, 4), dtype=np.int32),
        "odd": rng.standard_normal((7, 5), dtype=np.float32),  # fits no read sharding
        # layers alike: read once stacked (jax/read_once.py)
        **{f"l{k}": rng.standard_normal((64, 32), dtype=np.float32) for k in range(3)},
    }


def save(args) -> None:
    init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    g = global_arrays()
    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(jax.process_count(), -1), ("data", "model"))

    def put(x, *spec):
        s = NamedSharding(mesh, P(*spec))
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    tree = {
        "params": {"w": put(g["w"], "data", "model"), "e": put(g["e"], None, "model")},
        "b": put(g["b"]),
        "i": put(g["i"], "data"),
        "odd": put(g["odd"]),
        "layers": [put(g[f"l{k}"], "data", "model") for k in range(3)],
    }
    if args.safetensors:
        import snapshard.safetensors

        snapshard.safetensors.save(args.ckpt, tree)
        report(ok=True)
        return
    keys = jax.random.split(jax.random.key(3), 8)
    on_mesh = jax.jit(lambda k: k, out_shardings=NamedSharding(mesh, P(("data", "model"))))
    tree |= {"key": on_mesh(keys), "h": np.arange(64, dtype=np.float32), "step": 5}
    if args.manager:
        with snapshard.CheckpointManager(args.ckpt) as mgr:
            mgr.save(5, tree)
    else:
        snapshard.save(args.ckpt, tree)
    report(ok=True)


def restore(args) -> None:
    pid, n = init()
    report(**restored(args, pid, n))


def restores(args) -> None:
    pid, n = init()
    for case in args.cases:
        one = parser().parse_args(["restore", args.ckpt, *case.split()])
        report(**restored(one, pid, n, case=case))


def restored(args, pid: int, n: int, **tag: str) -> dict:
    """One restore's report (`tag` in it); a failed one reports and exits the process."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    g = global_arrays()
    devs = np.array(jax.devices())
    rows = {"rep4": n, "rep2": 2, "cols": 1}[args.layout]
    mesh = Mesh(devs.reshape(rows, -1), ("data", "model"))

    def sds(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    cols = P(None, "model")
    arrays = {
        "params": {"w": sds(g["w"], cols), "e": sds(g["e"], cols if rows == 1 else P())},
        "b": sds(g["b"], P()),
        "i": sds(g["i"], cols),
        "odd": sds(g["odd"], P()),
        "layers": [sds(g[f"l{k}"], cols) for k in range(3)],
    }
    target = dict(arrays)
    if not args.safetensors:
        key = jax.random.split(jax.random.key(3), 8)
        target |= {
            "key": jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P())),
            "h": np.zeros((64,), np.float32),
        }
    if args.fail_read == pid:
        from snapshard.errors import StorageError
        from snapshard.storage import local

        def read_into(self, name, offset, buffers):
            raise StorageError(f"injected read failure on process {pid}")

        local.LocalStorage.read_into = read_into
    stats = snapshard.ReadStats()
    budget = {"memory_budget": args.budget} if args.budget else {}
    options = snapshard.ReadOptions(
        read_once=None if args.default else not args.no_read_once,
        timeout_s=args.timeout,
        **budget,
    )
    t0 = time.perf_counter()
    # An ambient mesh must not matter: read-once passes its shardings explicitly.
    ambient = jax.set_mesh(Mesh(devs.reshape(-1), ("other",)))
    try:
        if args.safetensors:
            import snapshard.safetensors

            out = snapshard.safetensors.load(args.ckpt, target, options, stats=stats)
        elif args.manager:
            with snapshard.CheckpointManager(args.ckpt) as mgr:
                out = mgr.restore(5, target, options, stats=stats)
                peers = mgr.last_restore.bytes_from_peers
                assert peers == stats.bytes_from_peers, (peers, stats.bytes_from_peers)
        else:
            out = snapshard.load(args.ckpt, target, options, stats=stats)
    except Exception as e:
        report(**tag, ok=False, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        exit_after_failure(3)
    finally:
        ambient.__exit__(None, None, None)
    seconds = time.perf_counter() - t0
    ok = True
    unique = 0
    layers = [(f"l{k}", out["layers"][k], arrays["layers"][k]) for k in range(3)]
    for name, x, want in [
        ("w", out["params"]["w"], arrays["params"]["w"]),
        ("e", out["params"]["e"], arrays["params"]["e"]),
        *[(k, out[k], arrays[k]) for k in ("b", "i", "odd")],
        *layers,
    ]:
        ref = g[name]
        unique += ref.nbytes
        ok &= x.sharding == want.sharding
        for s in x.addressable_shards:
            ok &= np.asarray(s.data).tobytes() == ref[s.index].tobytes()
    if not args.safetensors:
        ok &= bool(np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(key)))
        ok &= out["h"].tobytes() == np.arange(64, dtype=np.float32).tobytes()
    return dict(**tag, ok=bool(ok), stats=stats.as_dict(), unique=unique, seconds=seconds)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("op", choices=["save", "restore"])
    ap.add_argument("ckpt")
    ap.add_argument("layout", nargs="?", default="rep4")
    ap.add_argument("--no-read-once", action="store_true")
    ap.add_argument("--default", action="store_true", help="read_once=None")
    ap.add_argument("--fail-read", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--safetensors", action="store_true")
    ap.add_argument("--manager", action="store_true")
    ap.add_argument("--budget", type=int, default=0, help="memory_budget in bytes")
    return ap


def main() -> None:
    import sys

    if sys.argv[1] == "restores":
        ap = argparse.ArgumentParser()
        ap.add_argument("op")
        ap.add_argument("ckpt")
        ap.add_argument("cases", nargs="+")
        restores(ap.parse_args())
        return
    args = parser().parse_args()
    save(args) if args.op == "save" else restore(args)


if __name__ == "__main__":
    main()
