"""Orbax with its defaults: ocp.CheckpointManager (async), StandardSave / StandardRestore.

One process, 8 CPU devices. Per run: save() (blocking) -> wait_until_finished() (total) ->
restore into the save sharding (files warm in the page cache) -> restore onto mesh (4, 2)
P('model', None) (warm) -> evict the files -> restore into the save sharding (evicted).
Durability is Orbax's default: TensorStore fsyncs every data file and OCDBT manifest.

usage: python job_orbax.py [--scale S] [--round R] [--no-evicted]
"""

from __future__ import annotations

import argparse
import os
import warnings

import common as bc

bc.force_cpu_devices(8)

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

warnings.filterwarnings("ignore")


def run(tree, path, scale, record, evicted):
    save_mesh, reshard_mesh = bc.mesh(2, 4), bc.mesh(4, 2)
    bc.fresh_dir(path)
    bc.settle()
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=True)
    mngr = ocp.CheckpointManager(path, options=opts)
    res = {}
    try:
        with bc.Meter() as total:
            with bc.Meter() as blk:
                mngr.save(0, args=ocp.args.StandardSave(tree))
            mngr.wait_until_finished()
        res.update(blk.as_dict("blocking"))
        res.update(total.as_dict("save"))
        res["disk_B"], res["disk_files"] = bc.du_bytes(path)
        targets = {
            "restore_warm": bc.abstract(tree, scale, save_mesh, False),
            "reshard_warm": bc.abstract(tree, scale, reshard_mesh, True),
        }
        bc.delete_tree(tree)  # the source is not needed any more: keep the peak RSS down
        ok = True
        steps = ["restore_warm", "reshard_warm"] + (["restore_evicted"] if evicted else [])
        for step in steps:
            target = targets["reshard_warm" if step == "reshard_warm" else "restore_warm"]
            if step == "restore_evicted":
                bc.evict(path)
            with bc.Meter() as m:
                out = jax.block_until_ready(mngr.restore(0, args=ocp.args.StandardRestore(target)))
            res.update(m.as_dict(step))
            if record:
                ok &= bc.check_restored(bc.flatten(out), scale)
            bc.delete_tree(out)
            del out
        res["bit_exact"] = ok
    finally:
        mngr.close()
        bc.remove(path)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--no-evicted", action="store_true")
    args = ap.parse_args()
    names = list(bc.tree_spec(args.scale))
    path = bc.ckpt_dir("orbax")
    warm = bc.build_tree(bc.WARMUP_LEAVES, args.scale, bc.mesh(2, 4))
    run(warm, path + "-warmup", args.scale, False, False)
    tree = bc.build_tree(names, args.scale, bc.mesh(2, 4))
    res = run(tree, path, args.scale, True, not args.no_evicted)
    bc.emit(method="orbax", bytes=bc.payload_bytes(args.scale), **res)
    os.sync()


if __name__ == "__main__":
    main()
