"""snapshard, the same steps as the Orbax job: durable save (`snapshard.save`, synchronous:
data files, index and manifest fsync'd, renamed into place) -> restore into the save sharding
(warm, the saved tree still alive) -> delete the tree -> the same restore (warm) and again
-> restore onto mesh (4, 2) P('model', None) (warm) -> evict -> restore (evicted).
Every restore verifies checksums (the default) and reports snapshard.ReadStats.

usage: python job_snapshard.py [--scale S] [--round R] [--no-evicted] [--profile]
--profile samples every thread during each step and prints where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import os

import common as bc
from sampler import Sampler

bc.force_cpu_devices(8)

import jax  # noqa: E402

import snapshard  # noqa: E402


def run(tree, path, scale, record, evicted, profile=False):
    def sampled(step):
        return Sampler() if profile else contextlib.nullcontext()

    reports = []

    save_mesh, reshard_mesh = bc.mesh(2, 4), bc.mesh(4, 2)
    bc.fresh_dir(path)
    bc.settle()
    res = {}
    try:
        with bc.Meter() as m, sampled("save") as smp:
            timings = snapshard.save(path, tree)
        if smp is not None:
            reports.append(smp.report(f"save {timings.as_dict()}"))
        res.update(m.as_dict("save"))
        res["blocking_s"] = round(timings.blocking_s, 4)
        res["timings"] = timings.as_dict()
        res["bytes_written"] = timings.bytes_written
        res["disk_B"], res["disk_files"] = bc.du_bytes(path)
        targets = {
            "restore_warm": bc.abstract(tree, scale, save_mesh, False),
            "reshard_warm": bc.abstract(tree, scale, reshard_mesh, True),
        }
        ok = True
        # restore_alive runs while the saved tree is still alive, as right after a save in a
        # training process: its memory is fresh. Then, as in the Orbax job, the source is
        # deleted and the restores reuse memory the process freed.
        steps = ["restore_alive", "restore_warm", "restore_repeat", "reshard_warm"]
        steps += ["restore_evicted"] if evicted else []
        for step in steps:
            if step == "restore_warm":
                bc.delete_tree(tree)  # not needed any more: keep the peak RSS down
            target = targets["reshard_warm" if step == "reshard_warm" else "restore_warm"]
            if step == "restore_evicted":
                bc.evict(path)
            stats = snapshard.ReadStats()
            with bc.Meter() as m, sampled(step) as smp:
                out = jax.block_until_ready(snapshard.load(path, target, stats=stats))
            if smp is not None:
                reports.append(smp.report(f"{step} {stats.as_dict()}"))
            res.update(m.as_dict(step))
            res[f"{step}_stats"] = stats.as_dict()
            if record:
                ok &= bc.check_restored(bc.flatten(out), scale)
            bc.delete_tree(out)
            del out
        res["bit_exact"] = ok
    finally:
        bc.remove(path)
    for r in reports:
        print(r, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--no-evicted", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    names = list(bc.tree_spec(args.scale))
    path = bc.ckpt_dir("snapshard")
    warm = bc.build_tree(bc.WARMUP_LEAVES, args.scale, bc.mesh(2, 4))
    run(warm, path + "-warmup", args.scale, False, False)
    tree = bc.build_tree(names, args.scale, bc.mesh(2, 4))
    res = run(tree, path, args.scale, True, not args.no_evicted, args.profile)
    bc.emit(method="snapshard", bytes=bc.payload_bytes(args.scale), **res)
    os.sync()


if __name__ == "__main__":
    main()
