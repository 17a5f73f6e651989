"""A/B of snapshard.torch's restore from a cold page cache against the raw read of the same
bytes, and of the read path's parts, side by side in one torchrun job.

bench_mlperf_shape.py's restores swing by 2x from one to the next on this project's disk.
This puts the variants next to each other: bench/job_mlperf.py's ZeRO-3 state (DTensors cut
Shard(0) over the ranks) is saved once by snapshard.torch and once raw (one file per rank);
then every rep runs each variant once, in order, each after every file was fsync'd and
dropped from the page cache, each rank timing its own call after a barrier. Reported per
variant: the slowest rank's seconds per rep, its throughput over raw's in the same rep
(median [per rep]) and the CPU seconds of all ranks.

Variants (comma-separated, --variants):
  raw          os.readv of the rank's file straight into its tensors (job_mlperf.raw_load)
  files        a plain front-to-back read of the rank's snapshard data files, 8 MiB at a time,
               into a scratch buffer: what their layout costs, with no library
  snapshard    snapshard.torch.load(path, target) as it is
  no_prefetch  the same without the prefetch thread that asks the storage for the ranges
               ahead of the reads (reading.prefetch.Prefetch)
  no_fadvise   the same without POSIX_FADV_SEQUENTIAL on the data files it opens
  plain        neither of them
The last three switch a part off in this process only (module attributes), for the
measurement: no option of the library does.

usage: torchrun --nproc-per-node 2 bench/ab_cold_restore.py [--scale 0.005] [--reps 6]
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc
import job_mlperf as jm

VARIANTS = ("raw", "files", "snapshard", "no_prefetch", "no_fadvise", "plain")


class _NoPrefetch:
    def __init__(self, *args: Any) -> None:
        pass

    def started(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _read_files(paths: list[str]) -> None:
    buf = bytearray(8 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scale", type=float, default=0.005)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    if "raw" not in variants or set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: 'raw' and any of {', '.join(VARIANTS)}")

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import snapshard.storage.local as local
    import snapshard.torch as sst
    from snapshard.reading import reads

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    cfg = jm.shape_for(args.scale)
    fqns = [f for f, _ in jm.params(cfg)]
    state = jm.build(cfg, mesh, fill=True)
    root = bc.ckpt_dir("ab-cold-restore")
    ckpt, raw_dir = os.path.join(root, "snapshard"), os.path.join(root, "raw")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    sst.save(ckpt, jm.state_dict(state, fqns))
    jm.raw_save(jm.local_tensors(state, fqns), raw_dir, rank)
    mine = sorted(glob.glob(os.path.join(ckpt, "data", f"p{rank:05d}-*")))
    target = jm.build(cfg, mesh, fill=False)
    target_sd, target_tensors = jm.state_dict(target, fqns), jm.local_tensors(target, fqns)
    prefetch, fadvise = reads.Prefetch, local._FADV_SEQUENTIAL

    seconds: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.reps):
        for v in variants:
            if rank == 0:
                jm.evict(ckpt)
                jm.evict(raw_dir)
            reads.Prefetch = _NoPrefetch if v in ("no_prefetch", "plain") else prefetch  # type: ignore[misc]
            local._FADV_SEQUENTIAL = None if v in ("no_fadvise", "plain") else fadvise
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if v == "raw":
                jm.raw_load(target_tensors, raw_dir, rank)
            elif v == "files":
                _read_files(mine)
            else:
                sst.load(ckpt, target_sd)
            took = (time.perf_counter() - t0, time.process_time() - c0)
            every: list[Any] = [None] * world
            dist.all_gather_object(every, took)
            seconds[v].append(max(t for t, _ in every))
            cpu[v].append(sum(c for _, c in every))
    if rank == 0:
        total = sum(t.numel() * t.element_size() for t in target_tensors) * world
        print(f"{world} ranks, {total / 1e9:.3f} GB, {args.reps} reps")
        print("| variant | slowest rank s | throughput / raw, same rep | CPU s, all ranks |")
        print("|---|---|---|---|")
        for v in variants:
            ratios = [r / s for r, s in zip(seconds["raw"], seconds[v], strict=True)]
            print(
                f"| {v} | {bc.spread(seconds[v], 3)} | {statistics.median(ratios):.2f} "
                f"{[round(x, 2) for x in ratios]} | {bc.spread(cpu[v])} |"
            )
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()  # ranks that left first aborted in gloo's teardown ("terminate called")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
