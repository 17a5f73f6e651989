"""snapshard, the same steps as the Orbax job: durable save (`snapshard.save`, synchronous:
data files, index and manifest fsync'd, renamed into place) -> restore into the save sharding
(warm) -> restore onto mesh (4, 2) P('model', None) (warm) -> evict -> restore (evicted).
Every restore verifies checksums (the default) and reports snapshard.ReadStats.

usage: python job_snapshard.py [--scale S] [--round R] [--no-evicted]
"""

from __future__ import annotations

import argparse
import os

import common as bc

bc.force_cpu_devices(8)

import jax  # noqa: E402

import snapshard  # noqa: E402


def run(tree, path, scale, record, evicted):
    save_mesh, reshard_mesh = bc.mesh(2, 4), bc.mesh(4, 2)
    bc.fresh_dir(path)
    bc.settle()
    res = {}
    try:
        with bc.Meter() as m:
            timings = snapshard.save(path, tree)
        res.update(m.as_dict("save"))
        res["blocking_s"] = round(timings.blocking_s, 4)
        res["timings"] = timings.as_dict()
        res["bytes_written"] = timings.bytes_written
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
            stats = snapshard.ReadStats()
            with bc.Meter() as m:
                out = jax.block_until_ready(snapshard.load(path, target, stats=stats))
            res.update(m.as_dict(step))
            res[f"{step}_stats"] = stats.as_dict()
            if record:
                ok &= bc.check_restored(bc.flatten(out), scale)
            bc.delete_tree(out)
            del out
        res["bit_exact"] = ok
    finally:
        bc.remove(path)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--no-evicted", action="store_true")
    args = ap.parse_args()
    names = list(bc.tree_spec(args.scale))
    path = bc.ckpt_dir("snapshard")
    warm = bc.build_tree(bc.WARMUP_LEAVES, args.scale, bc.mesh(2, 4))
    run(warm, path + "-warmup", args.scale, False, False)
    tree = bc.build_tree(names, args.scale, bc.mesh(2, 4))
    res = run(tree, path, args.scale, True, not args.no_evicted)
    bc.emit(method="snapshard", bytes=bc.payload_bytes(args.scale), **res)
    os.sync()


if __name__ == "__main__":
    main()
