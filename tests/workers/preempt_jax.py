"""Multi-process worker: a JAX job with the preemption service off, preempted on one process.

usage: preempt_jax.py DIR
Each step runs a collective; process 1 calls notify_preemption() at step 3, after process 0
has checked that step. The processes agree on the step through the coordinator (JAX's
coordination service); reports the step each saved at, the committed steps and whether the
restored state is right.
"""

from __future__ import annotations

import sys
import time

from snapshard import ReadOptions, SaveOptions

SIGNALLED_AT = 3


def main() -> None:
    directory = sys.argv[1]
    import jax

    jax.config.update("jax_enable_preemption_service", False)
    from _dist import init, report

    pid, _ = init()
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    sharding = NamedSharding(mesh, P(None, "model"))
    w = jax.jit(lambda: jax.numpy.zeros((16, 8), jax.numpy.float32), out_shardings=sharding)()
    manager = snapshard.CheckpointManager(
        directory,
        save_interval_steps=1000,
        save_options=SaveOptions(timeout_s=30),
        read_options=ReadOptions(timeout_s=30),
    )
    agreed = None
    for step in range(1, 12):
        w = jax.jit(lambda a: a + 1)(w)
        multihost_utils.process_allgather(np.array([step]))  # the processes stay in step
        if pid == 1 and step == SIGNALLED_AT:
            manager.notify_preemption()
            time.sleep(0.3)
        if manager.reached_preemption(step):
            assert manager.save(step, {"w": w, "step": step}, force=True)
            agreed = step
            break
    manager.wait_until_finished()
    ok = None
    if agreed is not None:
        out = manager.restore(
            target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding), "step": 0}
        )
        ok = out["step"] == agreed and all(
            np.array_equal(np.asarray(s.data), np.full(s.data.shape, agreed, np.float32))
            for s in out["w"].addressable_shards
        )
    report(pid=pid, agreed=agreed, steps=manager.all_steps(), ok=ok)
    manager.close()


if __name__ == "__main__":
    main()
