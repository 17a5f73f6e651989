"""Multi-process worker for the local tier: save steps to both tiers, or restore.

usage: tiers.py save PERSISTENT LOCAL STEPS PERSIST_EVERY
       tiers.py restore PERSISTENT LOCAL
       tiers.py restores ROOT...   one restore after the other in one job, from each ROOT's
                                   persistent/ and local/ (each reported with "case": ROOT)
"""

from __future__ import annotations

import sys

from _dist import init, report

from snapshard import ReadOptions, SaveOptions


def state(step, mesh):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    w = np.arange(256 * 64, dtype=np.float32).reshape(256, 64) + step
    sharding = NamedSharding(mesh, P(None, "model"))
    keys = jax.random.split(jax.random.key(step), 8)
    return {
        "w": jax.make_array_from_callback(w.shape, sharding, lambda i: w[i]),
        "e": jax.make_array_from_callback(
            (16, 8),
            NamedSharding(mesh, P("data", "model")),
            lambda i: np.full((16, 8), step, np.int32)[i],
        ),
        "keys": jax.jit(lambda k: k, out_shardings=NamedSharding(mesh, P("model")))(keys),
        "host": np.full(3, step, np.int64),
        "step": step,
    }


def main() -> None:
    op, persistent, local = (*sys.argv, "")[1:4]
    pid, _ = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import snapshard

    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    if op == "save":
        steps, every = int(sys.argv[4]), int(sys.argv[5])
        tier = snapshard.LocalTier(local, interval=1, max_to_keep=3, replicas=1)
        with snapshard.CheckpointManager(
            persistent,
            save_interval_steps=every,
            local_tier=tier,
            save_options=SaveOptions(timeout_s=60),
            read_options=ReadOptions(timeout_s=60),
        ) as m:
            for step in range(1, steps + 1):
                m.save(step, state(step, mesh))
            m.wait_until_finished()
            report(
                persistent=m.all_steps(),
                reports={str(k): v.as_dict() for k, v in m.tier_reports().items()},
            )
        return
    if op == "restores":
        for root in sys.argv[2:]:
            report(case=root, **restored(f"{root}/persistent", f"{root}/local", mesh, pid))
        return
    report(**restored(persistent, local, mesh, pid))


def restored(persistent, local, mesh, pid) -> dict:
    """A fresh manager's restore of the newest step, checked against `state(step)`."""
    import jax
    import numpy as np

    import snapshard

    tier = snapshard.LocalTier(local, interval=1, max_to_keep=3, replicas=1)
    m = snapshard.CheckpointManager(
        persistent,
        save_interval_steps=1000,
        local_tier=tier,
        save_options=SaveOptions(timeout_s=60),
        read_options=ReadOptions(timeout_s=60),
    )
    proto = state(0, mesh)
    target = jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        proto,
    )
    out = m.restore(target=target)
    step = out["step"]
    want = state(step, mesh)
    ok = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for name in ("w", "e")
        for a, b in zip(out[name].addressable_shards, want[name].addressable_shards, strict=True)
    )
    ok &= all(
        np.array_equal(
            np.asarray(jax.random.key_data(a.data)), np.asarray(jax.random.key_data(b.data))
        )
        for a, b in zip(
            out["keys"].addressable_shards, want["keys"].addressable_shards, strict=True
        )
    )
    ok &= out["host"].tolist() == [step] * 3 and out["keys"].sharding == want["keys"].sharding
    result = dict(
        ok=bool(ok),
        step=step,
        restore=m.last_restore.as_dict() if m.last_restore else None,
        pid=pid,
    )
    m.close()
    return result


if __name__ == "__main__":
    main()
