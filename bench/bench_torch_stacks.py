"""The torch stacks' checkpoint entry points on one state, side by side in one run: DCP's
dcp.save / dcp.load with FileSystemWriter / FileSystemReader (the stack's default), the same
calls through snapshard.torch.StorageWriter / StorageReader, snapshard.torch.save / load
direct, and torch-checkpointing's CheckpointManager (the library torchtitan 0.3 depends on;
synchronous saver; no resharder, whose
metadata gather needs CUDA in 0.1.1, so each rank writes and reads its own shards).

The state and its layout are bench_dcp_storage's (common.tree_spec as an FSDP2-style
DTensor state dict over R gloo ranks; ~2 GiB at --scale 1, many tensors): every save is
durable and fresh, every restore goes into zeroed targets of the save layout from the page
cache and is checked bit for bit on one leaf. A time is the slowest rank's. Each round runs
the saves, then the restores, in an order drawn for the round (the first in the listed
order); round 0 warms up and is not recorded. Each run is a fresh set of processes.

    python bench/bench_torch_stacks.py --scale 0.125 --rounds 5   # ~270 MiB

Prints medians and the median over rounds of each time to DCP with FileSystemWriter/Reader;
writes JSON lines (--out, default bench/results/torch-stacks-<time>.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import bench_dcp_storage as ds
import common as bc

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
TC = "torch-checkpointing"


def _tc_manager() -> Any:
    from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    config = CheckpointManager.Config(
        # No resharder: its metadata gather allocates on CUDA (torch-checkpointing 0.1.1), so
        # on CPU each rank saves and loads its own shards (the layout-unchanged path).
        items={"model": ItemSpec(requires_copy=False)},
        save=SyncCheckpointSaverConfig(),
        # Its default O_DIRECT writes fail here on close (EINVAL: a tail not a multiple of
        # the block size), so buffered writes, fsynced below like FileSystemWriter's.
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    )
    return config.build()


def _tc_save(mgr: Any, sd: dict[str, torch.Tensor], path: str) -> None:
    mgr.save(path, {"model": sd})
    if dist.get_rank() == 0:  # durable as the others: every file and directory fsynced
        for d, _, files in os.walk(path):
            for f in files:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        ds._fsync_tree(path)


def _tc_load(mgr: Any, sd: dict[str, torch.Tensor], path: str) -> None:
    got = mgr.load(path, into={"model": sd})["model"]
    if got is not sd:  # if the library hands back new tensors, the check must see them
        for k, v in got.items():
            sd[k] = v


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
        world_size=args.ranks, timeout=timedelta(seconds=900),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (args.ranks,))
    sd = ds.state(args.scale, mesh, fill=True)
    mgr = _tc_manager()
    saves = {**ds.SAVES, TC: lambda s, p: _tc_save(mgr, s, p)}
    loads = {**ds.LOADS, TC: lambda s, p: _tc_load(mgr, s, p)}
    root = os.path.join(bc.bench_dir(), "torch-stacks")
    if args.rank == 0:  # what a run that failed left
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    rows = []
    for rnd in range(args.rounds + 1):
        names = list(saves)
        if rnd > 1:
            random.Random(rnd).shuffle(names)
        paths = {n: os.path.join(root, f"r{rnd}-{n}") for n in names}
        for n in names:
            rows.append(
                {"round": rnd, "op": "save", "entry": n, "s": ds._timed(saves[n], sd, paths[n])}
            )
        for n in names:
            target = ds.state(args.scale, mesh, fill=False)
            secs = ds._timed(loads[n], target, paths[n])
            ds._check(target, args.scale, mesh)
            rows.append({"round": rnd, "op": "restore", "entry": n, "s": secs})
        dist.barrier()
        if args.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    mgr.close()
    if args.rank == 0:
        print("RESULT " + json.dumps([r for r in rows if r["round"] > 0]), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        worker(args)
        return
    port = ds._free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [sys.executable, __file__, "--ranks", str(args.ranks), "--scale", str(args.scale),
           "--rounds", str(args.rounds), "--port", str(port)]  # fmt: skip
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(args.ranks)
    ]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    rows = json.loads(line.removeprefix("RESULT "))
    out = args.out or os.path.join(
        HERE, "results", f"torch-stacks-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "ranks": args.ranks, "scale": args.scale}) + "\n")
    mib = bc.payload_bytes(args.scale) / 2**20
    print(f"{args.ranks} ranks, {mib:.0f} MiB, {args.rounds} rounds ({out})\n")
    print(ds.table(rows))


if __name__ == "__main__":
    main()
