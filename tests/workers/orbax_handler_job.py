"""Multi-process worker: Orbax's CheckpointManager over snapshard.orbax.Handler.

usage: orbax_handler_job.py train ROOT STEPS KILL_STEP   # saves every 2nd step, keeps 2;
                                                         # process 1 SIGKILLs itself right
                                                         # after starting the save of
                                                         # KILL_STEP (-1: no kill)
       orbax_handler_job.py restore ROOT                 # the latest step onto this job's
                                                         # mesh (all devices, rows split)
       orbax_handler_job.py v1 PATH                      # state_at(3) saved and loaded
                                                         # through Orbax's v1 API
The state of step s is `state_at(s)`; every process reports whether each addressable shard
it restored holds the right values. (`_dist` is imported where it is used, so that the
tests can import `state_at`.)
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

ROWS, COLS = 12, 8


def state_at(step: int) -> dict:
    """The host values of the state saved at `step`."""
    w = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 1000 * step
    return {"w": w, "b": np.full((COLS,), step, np.int32), "step": step}


def manager(root: str):
    import orbax.checkpoint as ocp

    import snapshard.orbax

    opts = ocp.CheckpointManagerOptions(
        save_interval_steps=2, max_to_keep=2, cleanup_tmp_directories=True
    )
    return ocp.CheckpointManager(
        root, options=opts, item_names=("state",),
        item_handlers={"state": snapshard.orbax.Handler()},
    )  # fmt: skip


def train(root: str, steps: int, kill_step: int) -> None:
    from _dist import init, report

    pid, _ = init()
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard.orbax

    mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))
    shardings = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P())}
    mgr = manager(root)
    saved = []
    for step in range(steps):
        host = state_at(step)
        state = {k: jax.device_put(host[k], shardings[k]) for k in ("w", "b")}
        state["step"] = step
        if mgr.save(step, args=ocp.args.Composite(state=snapshard.orbax.Save(state))):
            saved.append(step)
            if step == kill_step and pid == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # the save of this step is in flight
    mgr.wait_until_finished()
    report(pid=pid, saved=saved, steps=mgr.all_steps())
    mgr.close()


def on_rows() -> dict:
    """The restore target: `w` split by rows over every device of the job, `b` replicated."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("rows",))
    return {
        "w": jax.ShapeDtypeStruct(
            (ROWS, COLS), np.float32, sharding=NamedSharding(mesh, P("rows"))
        ),
        "b": jax.ShapeDtypeStruct((COLS,), np.int32, sharding=NamedSharding(mesh, P())),
        "step": 0,
    }


def holds(state: dict, step: int) -> bool:
    """Every addressable shard of the restored `state` holds `state_at(step)`'s values."""
    want = state_at(step)
    return state["step"] == step and all(
        np.array_equal(np.asarray(s.data), want[k][s.index])
        for k in ("w", "b")
        for s in state[k].addressable_shards
    )


def restore(root: str) -> None:
    from _dist import init, report

    pid, n = init()
    import orbax.checkpoint as ocp

    import snapshard.orbax

    mgr = manager(root)
    step = mgr.latest_step()
    out = mgr.restore(step, args=ocp.args.Composite(state=snapshard.orbax.Restore(on_rows())))
    state = out["state"]
    shards = len(state["w"].addressable_shards)
    ok = holds(state, step)
    report(pid=pid, processes=n, step=step, steps=mgr.all_steps(), ok=ok, shards=shards)
    mgr.close()


def v1_roundtrip(path: str) -> None:
    from _dist import init, report

    pid, n = init()
    import jax
    import orbax.checkpoint.experimental.v1 as v1
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard.orbax

    mesh = jax.make_mesh((n, jax.device_count() // n), ("data", "model"))
    host = state_at(3)
    state = {
        "w": jax.device_put(host["w"], NamedSharding(mesh, P("model", "data"))),
        "b": jax.device_put(host["b"], NamedSharding(mesh, P())),
        "step": 3,
    }
    registry = v1.handlers.local_registry()
    registry.add(snapshard.orbax.CheckpointableHandler, checkpointable_name="train_state")
    ctx = v1.Context()
    ctx.checkpointables.registry = registry
    with ctx:
        v1.save_checkpointables(path, {"train_state": state})
        out = v1.load_checkpointables(path, {"train_state": on_rows()})["train_state"]
    report(pid=pid, ok=holds(out, 3))


if __name__ == "__main__":
    cmd, root, *rest = sys.argv[1:]
    if cmd == "train":
        train(root, int(rest[0]), int(rest[1]))
    elif cmd == "v1":
        v1_roundtrip(root)
    else:
        restore(root)
