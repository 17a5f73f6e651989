"""One asynchronous save of the bench state: how long the training step waits, and how long
until the checkpoint is durable.

Variants (one per process run):
  copy        a plain host copy of the bytes this process owns (np.array of every owned
              slice): what a save that copies before returning costs at least
  snapshard   snapshard.CheckpointManager (async): save() blocking, wait_until_finished() total
  orbax       ocp.CheckpointManager (async), Orbax's defaults (replica-parallel on CPU)
  orbax_norp  the same with ArrayHandler(use_replica_parallel=False)
The managers save twice; the second save (steady state of a training loop) is reported, the
first one's blocking time too (first_blocking_s).
Barriers per save are counted by bench_multiprocess.py (they are no-ops in one process).

usage: python job_async.py VARIANT [--scale S] [--round R]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import common as bc

bc.force_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

warnings.filterwarnings("ignore")


def plain_copy(tree) -> dict:
    """Copy every owned slice (the plan's items of this process) into fresh host memory."""
    import snapshard.jax  # noqa: F401  (the JAX wing classifies jax.Arrays)
    from snapshard.planning import plan_writes
    from snapshard.saving.save_array import classify
    from snapshard.tree import flatten

    flat = flatten(tree, lambda x: isinstance(x, jax.Array))
    arrays = [classify(p, v, 1) for p, v in zip(flat.paths, flat.leaves, strict=True)]
    plan = plan_writes([a.layout for a in arrays], num_processes=1)
    with bc.Meter() as m:
        copies = []
        mine = plan.process_items(0)
        for a, k in zip(mine.array.tolist(), mine.item.tolist(), strict=True):
            arr, p = arrays[a], plan.arrays[a]
            shard = {s.device: s for s in arr.source.addressable_shards}[
                arr.devices[p.source_row[k]]
            ]
            origin = arr.layout.starts[p.source_row[k]]
            rel = tuple(
                slice(int(s - o), int(e - o))
                for s, e, o in zip(p.starts[k], p.stops[k], origin, strict=True)
            )
            copies.append(np.array(np.asarray(shard.data)[rel], copy=True))
    return {**m.as_dict("blocking"), "copied_bytes": sum(c.nbytes for c in copies)}


def snapshard_save(tree, path) -> dict:
    """Two managed saves; the second is the steady state of a training loop (plans cached)."""
    import snapshard

    bc.fresh_dir(path)
    bc.settle()
    with snapshard.CheckpointManager(path) as m:
        with bc.Meter() as first:
            m.save(1, tree)
        m.wait_until_finished()
        bc.settle()
        with bc.Meter() as total:
            with bc.Meter() as blk:
                m.save(2, tree)
            m.wait_until_finished()
    bc.remove(path)
    return {
        **blk.as_dict("blocking"),
        **total.as_dict("save"),
        "first_blocking_s": round(first.wall, 4),
    }


def orbax_save(tree, path, replica_parallel: bool) -> dict:
    import orbax.checkpoint as ocp

    handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel)
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    bc.fresh_dir(path)
    bc.settle()
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=True)
    mngr = ocp.CheckpointManager(path, options=opts)
    try:
        with bc.Meter() as first:
            mngr.save(1, args=ocp.args.StandardSave(tree))
        mngr.wait_until_finished()
        bc.settle()
        with bc.Meter() as total:
            with bc.Meter() as blk:
                mngr.save(2, args=ocp.args.StandardSave(tree))
            mngr.wait_until_finished()
    finally:
        mngr.close()
        bc.remove(path)
    return {
        **blk.as_dict("blocking"),
        **total.as_dict("save"),
        "first_blocking_s": round(first.wall, 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=["copy", "snapshard", "orbax", "orbax_norp"])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    args = ap.parse_args()
    path = bc.ckpt_dir(f"async-{args.variant}")

    def run(tree):
        if args.variant == "copy":
            return plain_copy(tree)
        if args.variant == "snapshard":
            return snapshard_save(tree, path)
        return orbax_save(tree, path, args.variant == "orbax")

    run(bc.build_tree(bc.WARMUP_LEAVES, args.scale, bc.mesh(2, 4)))  # warm-up, not recorded
    tree = bc.build_tree(list(bc.tree_spec(args.scale)), args.scale, bc.mesh(2, 4))
    time.sleep(0.5)
    res = run(tree)
    bc.emit(method=f"async_{args.variant}", bytes=bc.payload_bytes(args.scale), **res)
    os.sync()


if __name__ == "__main__":
    main()
