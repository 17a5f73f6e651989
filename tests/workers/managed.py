"""Multi-process worker: managed async saves of a sharded tree, then a restore.

usage: managed.py DIR STEPS
Reports the barriers (and blocking key-value waits) of the coordination service used per
save, the committed steps, and whether the restored state is right.
"""

from __future__ import annotations

import sys

from _dist import init, report

from snapshard import ReadOptions, SaveOptions


def main() -> None:
    directory, steps = sys.argv[1], int(sys.argv[2])
    pid, _ = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    from snapshard.jax.distributed import JaxDistributedCoordinator

    counts = {"barrier": 0, "get": 0}
    real_barrier, real_get = JaxDistributedCoordinator.barrier, JaxDistributedCoordinator.get

    def barrier(self, name, timeout_s):
        counts["barrier"] += 1
        return real_barrier(self, name, timeout_s)

    def get(self, key, timeout_s):
        counts["get"] += 1
        return real_get(self, key, timeout_s)

    JaxDistributedCoordinator.barrier = barrier
    JaxDistributedCoordinator.get = get

    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    sharding = NamedSharding(mesh, P(None, "model"))
    w = jax.jit(
        lambda: jax.numpy.arange(256 * 64, dtype=jax.numpy.float32).reshape(256, 64),
        out_shardings=sharding,
    )()
    manager = snapshard.CheckpointManager(
        directory,
        max_to_keep=2,
        save_options=SaveOptions(timeout_s=60),
        read_options=ReadOptions(timeout_s=60),
    )
    at_start = dict(counts)
    for step in range(1, steps + 1):
        w = jax.jit(lambda a: a + 1, donate_argnums=0)(w)
        manager.save(step, {"w": w, "step": step}, metrics={"step": step})
    manager.wait_until_finished()
    per_save = {k: (counts[k] - at_start[k]) / steps for k in counts}
    out = manager.restore(
        target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding), "step": 0}
    )
    expected = np.arange(256 * 64, dtype=np.float32).reshape(256, 64) + steps
    ok = out["step"] == steps and all(
        np.array_equal(np.asarray(s.data), expected[s.index]) for s in out["w"].addressable_shards
    )
    manager.close()
    report(ok=bool(ok), steps=manager.all_steps(), per_save=per_save, at_start=at_start, pid=pid)


if __name__ == "__main__":
    main()
