"""snapshard.torch against torch.distributed.checkpoint (DCP), side by side in one run.

The bench state (common.tree_spec) as a torch state dict of DTensors over R ranks (gloo,
CPU): weights and embeddings sharded by rows (what FSDP2 does), biases replicated. Every
save is durable (snapshard fsyncs files and directories; DCP's FileSystemWriter with
sync_files=True, plus a directory fsync here). Times are the slowest rank's.

    python bench/bench_torch.py [--ranks 2] [--scale 0.125] [--repeats 2]

Rows: a memcpy of the bytes each rank owns (the floor of an async blocking phase),
snapshard sync save, snapshard async (blocking / total), DCP sync save (1 and 2 threads),
DCP async_save (thread; blocking / total), restore onto the same layout (snapshard, DCP).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from datetime import timedelta

import numpy as np

import common as bc

warnings.filterwarnings("ignore")


def _state(world: int, rank: int, scale: float):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, (_shape, dt, kind) in bc.tree_spec(scale).items():
        a = bc.make_array(name, scale)
        if dt == "bfloat16":
            full = torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        else:
            full = torch.from_numpy(a)
        if kind == "w":
            local = full.chunk(world, dim=0)[rank].clone()
            out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        else:
            out[name] = DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
    return out


def _owned_bytes(state, world: int, rank: int) -> int:
    from torch.distributed.tensor import Shard

    total = 0
    for v in state.values():
        loc = v.to_local()
        n = loc.numel() * loc.element_size()
        total += n if isinstance(v.placements[0], Shard) else n // world
    return total


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import snapshard.torch as sst

    world, rank = args.ranks, args.rank
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    state = _state(world, rank, args.scale)
    async_group = dist.new_group(backend="gloo")  # DCP's async save talks in its own thread
    owned = _owned_bytes(state, world, rank)
    root = bc.ckpt_dir("torch")
    rows: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        gathered: list[float] = [0.0] * world
        dist.all_gather_object(gathered, dt)
        rows.setdefault(name, []).append(max(gathered))

    def fresh(name: str) -> str:
        path = os.path.join(root, name)
        if rank == 0:
            bc.remove(path)
            os.makedirs(root, exist_ok=True)
        dist.barrier()
        return path

    bufs = [
        np.empty(v.to_local().numel() * v.to_local().element_size(), np.uint8)
        for v in state.values()
    ]

    def memcpy() -> None:
        from snapshard.torch.dtypes import host_view

        for b, v in zip(bufs, state.values(), strict=True):
            np.copyto(b, host_view(v.to_local()).reshape(-1).view(np.uint8))

    def one_round() -> None:
        timed("memcpy of the local shards", memcpy)
        p = fresh("sst-sync")
        timed("snapshard save (sync)", lambda p=p: sst.save(p, state))
        p = fresh("sst-async")
        job: list = []
        timed("snapshard save_async: blocking", lambda p=p: job.append(sst.save_async(p, state)))
        timed("snapshard save_async: rest", lambda: job[-1].wait())
        for threads in (1, 2):
            p = fresh(f"dcp-t{threads}")

            def dcp_save(p=p, threads=threads) -> None:
                dcp.save(state, storage_writer=dcp.FileSystemWriter(p, thread_count=threads))
                if rank == 0:
                    bc.fsync_dir(p)

            timed(f"DCP save, {threads} thread(s)", dcp_save)
        p = fresh("dcp-async")
        fut: list = []
        timed(
            "DCP async_save (thread): blocking",
            lambda p=p: fut.append(
                dcp.async_save(
                    state, storage_writer=dcp.FileSystemWriter(p), process_group=async_group
                )
            ),
        )
        timed(
            "DCP async_save (thread): rest",
            lambda: getattr(fut[-1], "upload_completion", fut[-1]).result(),
        )
        target = {k: torch.empty_like(v) for k, v in state.items()}
        timed("snapshard load", lambda: sst.load(os.path.join(root, "sst-sync"), target))
        timed("DCP load", lambda: dcp.load(target, checkpoint_id=os.path.join(root, "dcp-t1")))

    for _ in range(args.repeats):
        one_round()
    if rank == 0:
        bc.emit(owned_bytes_per_rank=owned, payload=bc.payload_bytes(args.scale), rows=rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    port = bc.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--ranks",
                str(args.ranks),
                "--scale",
                str(args.scale),
                "--repeats",
                str(args.repeats),
                "--rank",
                str(r),
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for r in range(args.ranks)
    ]
    outs = [p.communicate()[0] for p in procs]
    result = next(
        json.loads(line[7:]) for line in outs[0].splitlines() if line.startswith("RESULT ")
    )
    print(
        f"\n{args.ranks} ranks, {result['payload'] / 2**20:.0f} MiB state, "
        f"{result['owned_bytes_per_rank'] / 2**20:.0f} MiB owned per rank; seconds, slowest rank\n"
    )
    print("| operation | s |")
    print("|---|---|")
    for name, v in result["rows"].items():
        print(f"| {name} | {bc.spread(v, 3)} |")


if __name__ == "__main__":
    main()
