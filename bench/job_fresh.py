"""Restore in a fresh process, what a restart pays: this process writes a snapshard
checkpoint of the state (untimed), then starts one fresh process per variant, in an order
rotated by the round (reversed in odd rounds), twice each, each after an untimed warm load
in a process of its own: `snapshard.load` warm,
`CheckpointManager.restore` warm, `load` after fadvise eviction, and `load` onto the
reshard layout, each timed from the call
to `block_until_ready` (imports and target building outside the time), after one untimed
`fresh_first` restore (see below).

usage: python job_fresh.py [--scale S] [--round R]
       python job_fresh.py --child VARIANT DIR [--scale S]     (one timed restore)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import common as bc

bc.force_cpu_devices(8)

VARIANTS = ("fresh_load_warm", "fresh_manager_warm", "fresh_load_evicted", "fresh_reshard_warm")
PRIMER = "primer"  # an untimed warm load before every timed variant


def child(variant: str, root: str, scale: float) -> None:
    import jax

    import snapshard

    reshard = variant == "fresh_reshard_warm"
    m = bc.mesh(4, 2) if reshard else bc.mesh(2, 4)
    spec = bc.tree_spec(scale)
    target = bc.nest(
        {
            k: jax.ShapeDtypeStruct(s, bc.np_dtype(dt), sharding=bc.sharding_for(kind, m, reshard))
            for k, (s, dt, kind) in spec.items()
        }
    )
    if variant == "fresh_load_evicted":
        bc.evict(root)
    mngr = snapshard.CheckpointManager(root) if variant == "fresh_manager_warm" else None
    stats = snapshard.ReadStats()
    with bc.Meter() as meter:
        if mngr is not None:
            out = jax.block_until_ready(mngr.restore(0, target=target))
        else:
            out = jax.block_until_ready(
                snapshard.load(os.path.join(root, "0"), target, stats=stats)
            )
    ok = bc.check_restored(bc.flatten(out), scale)
    if mngr is not None:
        mngr.close()
    print("CHILD " + json.dumps({**meter.as_dict("restore"), "stats": stats.as_dict(), "ok": ok}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "DIR"))
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.scale)
        return
    import snapshard

    root = bc.ckpt_dir("fresh")
    bc.fresh_dir(root)
    tree = bc.build_tree(list(bc.tree_spec(args.scale)), args.scale, bc.mesh(2, 4))
    snapshard.save(os.path.join(root, "0"), tree)
    bc.delete_tree(tree)
    del tree
    bc.settle()
    k = args.round % len(VARIANTS)
    # The first process to touch memory after a large free pays for it: this machine's
    # hypervisor takes freed guest memory back and faults it in again on first touch
    # (seconds for 2 GiB, whatever touches it). One untimed restore first gives every
    # timed variant the same start; its time is reported on its own (fresh_first).
    # Which process follows which matters too (the memory the one before freed may or may
    # not have been taken back yet: up to 1.5x on one variant), so every timed variant
    # follows the same untimed one, a warm load (PRIMER), and odd rounds also run the
    # variants in reverse order.
    turn = [*VARIANTS[k:], *VARIANTS[:k]]
    if args.round % 2:
        turn.reverse()
    order = ["fresh_first"]
    for v in [*turn, *turn]:
        order += [v] if order[-1] == "fresh_first" else [PRIMER, v]
    try:
        for v in order:
            mode = "fresh_load_warm" if v in ("fresh_first", PRIMER) else v
            cmd = [sys.executable, __file__, "--scale", str(args.scale), "--child", mode, root]
            p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
            if v == PRIMER:
                continue
            line = next(x for x in p.stdout.splitlines() if x.startswith("CHILD "))
            res = json.loads(line[6:])
            bc.emit(method=v, bytes=bc.payload_bytes(args.scale), bit_exact=res.pop("ok"), **res)
    finally:
        bc.remove(root)


if __name__ == "__main__":
    main()
