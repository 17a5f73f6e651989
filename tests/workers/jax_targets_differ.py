"""Multi-process worker (2 processes x 2 CPU devices): JAX loads whose targets differ by
process, and the local tier inside `jax.set_mesh`.

usage: jax_targets_differ.py DIR
   Saves three global arrays, then, for each case, process 1 loads with its own target
   while process 0 loads with the right one (read_once=True), then both load and save
   again: "shape" (process 1 asks for another shape: refused), "missing" (process 1 leaves
   a leaf out), "dtype" (process 1 asks for bfloat16), "unopened" (process 1 cannot open
   the checkpoint: refused). Then a CheckpointManager with a
   LocalTier saves and restores inside `with jax.set_mesh(mesh)` (Explicit axes).
   Reports, per case, the error (or None) and whether the loads after it came back equal.
"""

from __future__ import annotations

import sys

from _dist import init, report


def main() -> None:
    root = sys.argv[1]
    pid, n = init()
    import jax
    import ml_dtypes
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    from snapshard import ReadOptions

    rng = np.random.default_rng(1)
    data = {
        "full": rng.standard_normal((8, 4)).astype(np.float32),
        "cols": rng.standard_normal((4, 8)).astype(np.float32),
        "rep": rng.standard_normal((4, 2)).astype(np.float32),
    }
    mesh = jax.make_mesh((n, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    specs = {"full": P("data", "model"), "cols": P(None, "model"), "rep": P()}

    def put(k):
        x = data[k]
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, specs[k]), lambda i: x[i])

    def target(dtype=np.float32):
        sharding = NamedSharding(mesh, P())  # replicated: read once, then shared
        return {k: jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding) for k, x in data.items()}

    def equal(got):
        return all(
            np.array_equal(np.asarray(s.data, np.float32), data[k][s.index])
            for k in got for s in got[k].addressable_shards
        )  # fmt: skip

    opts = ReadOptions(read_once=True, timeout_s=60)
    path = f"{root}/ck"
    snapshard.save(path, {k: put(k) for k in data})
    out = {}
    from snapshard.errors import StorageError
    from snapshard.reading import sources

    opened = sources.open_checkpoint

    def refused(*args):
        raise StorageError(f"{path}: access denied (injected on process {pid})")

    for case in ("shape", "missing", "dtype", "unopened"):
        mine = target()
        if pid == 1 and case == "shape":
            mine["cols"] = jax.ShapeDtypeStruct(
                (4, 4), np.float32, sharding=NamedSharding(mesh, P())
            )
        elif pid == 1 and case == "missing":
            del mine["cols"]
        elif pid == 1 and case == "unopened":  # its credentials refused, or the step deleted
            sources.open_checkpoint = refused
        elif pid == 1:
            mine = target(ml_dtypes.bfloat16)
        error = None
        try:
            snapshard.load(path, mine, opts)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        sources.open_checkpoint = opened
        then = equal(snapshard.load(path, target(), opts))
        snapshard.save(path, {k: put(k) for k in data}, overwrite=True)
        out[case] = {"error": error, "then": then and equal(snapshard.load(path, target(), opts))}
    with jax.set_mesh(mesh):
        tier = snapshard.LocalTier(f"{root}/local")
        with snapshard.CheckpointManager(f"{root}/managed", local_tier=tier) as mgr:
            mgr.save(1, {"full": put("full")})
            mgr.wait_until_finished()
            want = {"full": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=put("full").sharding)}
            got = mgr.restore(1, target=want)
            out["local_tier"] = {"tier": mgr.last_restore.tier, "equal": equal(got)}
    report(pid=pid, **out)


if __name__ == "__main__":
    main()
