"""A/B of the durable save's writer threads against the raw fsync'd write, in one process.

The full benchmark's rounds are minutes apart, and on a shared machine the disk's speed
drifts within minutes. This puts the contenders side by side: every rep runs, in an order
rotated by the rep, the raw write of the state's bytes with 1 and 2 threads and
`snapshard.save(..., SaveOptions(writers=1|2))`, each after os.sync().

usage: python ab_save_threads.py [--scale S] [--reps 4]
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

import common as bc

bc.force_cpu_devices(8)

import snapshard  # noqa: E402
from job_phys import PIECE, write_file  # noqa: E402
from snapshard import SaveOptions  # noqa: E402


def raw_write(d: str, nbytes: int, threads: int, buf: np.ndarray) -> None:
    import threading

    sizes = [nbytes // threads + (1 if i < nbytes % threads else 0) for i in range(threads)]
    ts = [
        threading.Thread(target=write_file, args=(os.path.join(d, f"f{i}"), n, buf))
        for i, n in enumerate(sizes)
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    bc.fsync_path(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    nbytes = bc.payload_bytes(args.scale)
    tree = bc.build_tree(list(bc.tree_spec(args.scale)), args.scale, bc.mesh(2, 4))
    buf = np.random.default_rng(0).integers(0, 255, PIECE, dtype=np.uint8)
    root = bc.ckpt_dir("ab")
    bc.fresh_dir(root)
    os.makedirs(root)
    contenders = ["raw_t1", "raw_t2", "snapshard_t1", "snapshard_t2"]
    times: dict[str, list[float]] = {c: [] for c in contenders}
    try:
        for rep in range(args.reps):
            k = rep % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                path = os.path.join(root, c)
                bc.fresh_dir(path)
                if c.startswith("raw"):
                    os.makedirs(path)
                bc.settle()
                threads = int(c[-1])
                with bc.Meter() as m:
                    if c.startswith("raw"):
                        raw_write(path, nbytes, threads, buf)
                    else:
                        snapshard.save(path, tree, options=SaveOptions(writers=threads))
                times[c].append(m.wall)
                bc.emit(method=c, rep=rep, bytes=nbytes, **m.as_dict("op"))
                bc.remove(path)
    finally:
        bc.remove(root)
    print(f"\n| contender | median s [min-max] | GB/s | n |  ({nbytes:,} B)")
    print("|---|---|---|---|")
    for c, v in times.items():
        m = statistics.median(v)
        print(f"| {c} | {m:.2f} [{min(v):.2f}-{max(v):.2f}] | {nbytes / m / 1e9:.2f} | {len(v)} |")


if __name__ == "__main__":
    main()
