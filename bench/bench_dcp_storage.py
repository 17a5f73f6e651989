"""DCP's own dcp.save / dcp.load through snapshard's storage writer and reader, against DCP's
FileSystemWriter / FileSystemReader and against snapshard.torch direct, side by side in one
run.

The bench state (common.tree_spec; ~2 GiB at --scale 1) as an FSDP2-style state dict over R
gloo ranks (CPU): weights and embeddings DTensors with Shard(0), biases replicated DTensors.
Every save is durable (FileSystemWriter: sync_files=True; snapshard fsyncs its files and
directories) and writes a fresh checkpoint; restores go into zeroed targets of the save
layout and read files still in the page cache. A time is the slowest rank's (a barrier
before and after each operation). Every round runs the saves, then the restores, in an
order drawn for the round (seeded by it, the same on every rank; the first round in the
listed order), and checks one leaf of each restore bit for bit.

    python bench/bench_dcp_storage.py                            # 2 ranks, ~2 GiB, 3 rounds
    python bench/bench_dcp_storage.py --scale 0.125 --rounds 5   # ~270 MiB, quicker

Prints the medians and, per round, the ratio of each entry point's time to DCP with
FileSystemWriter/Reader (the median of those ratios: below 1 is faster); writes JSON lines
(--out, default bench/results/dcp-storage-<time>.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import common as bc
import snapshard.torch as sst

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE = "dcp+FileSystem"


def _fsync_tree(path: str) -> None:
    """FileSystemWriter fsyncs its files, not its directories: done here, as snapshard does."""
    for d, _, _ in os.walk(path):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _dcp_file_save(sd: dict[str, torch.Tensor], path: str) -> None:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))  # sync_files=True
    if dist.get_rank() == 0:  # after DCP's last collective every rank's files are in
        _fsync_tree(path)


SAVES = {
    BASELINE: _dcp_file_save,
    "dcp+snapshard": lambda sd, path: dcp.save(sd, storage_writer=sst.StorageWriter(path)),
    "snapshard.torch": lambda sd, path: sst.save(path, sd),
}
LOADS = {
    BASELINE: lambda sd, path: dcp.load(sd, storage_reader=dcp.FileSystemReader(path)),
    "dcp+snapshard": lambda sd, path: dcp.load(sd, storage_reader=sst.StorageReader(path)),
    "snapshard.torch": lambda sd, path: sst.load(path, sd),
}


def _full(name: str, scale: float) -> torch.Tensor:
    a = bc.make_array(name, scale)
    if a.dtype.itemsize == 2:  # bfloat16
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def state(scale: float, mesh: DeviceMesh, fill: bool) -> dict[str, torch.Tensor]:
    """name -> DTensor as FSDP2 lays it out (weights Shard(0), biases replicated): the
    bench values, or zeros (a restore target)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dt, kind) in bc.tree_spec(scale).items():
        placement = Shard(0) if kind == "w" else Replicate()
        if fill:
            full = _full(name, scale)
        else:
            full = torch.zeros(shape, dtype=torch.bfloat16 if dt == "bfloat16" else torch.float32)
        local = full.chunk(world, dim=0)[rank] if kind == "w" else full
        local = local.clone(memory_format=torch.contiguous_format)
        out[name] = DTensor.from_local(local, mesh, [placement], run_check=False)
    return out


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    dist.barrier()
    return time.perf_counter() - t0


def _check(sd: dict[str, torch.Tensor], scale: float, mesh: DeviceMesh) -> None:
    name = next(iter(sd))
    got = sd[name].full_tensor()
    if not torch.equal(
        got.view(-1).view(torch.uint8), _full(name, scale).view(-1).view(torch.uint8)
    ):
        raise SystemExit(f"restore of {name!r} is not bit-exact")


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
        world_size=args.ranks, timeout=timedelta(seconds=900),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (args.ranks,))
    sd = state(args.scale, mesh, fill=True)
    root = os.path.join(bc.bench_dir(), "dcp-storage")
    rows = []
    for rnd in range(args.rounds + 1):  # round 0 warms up: not recorded
        names = list(SAVES)
        if rnd > 1:
            random.Random(rnd).shuffle(names)
        paths = {n: os.path.join(root, f"r{rnd}-{n}") for n in names}
        for n in names:
            secs = _timed(SAVES[n], sd, paths[n])
            rows.append({"round": rnd, "op": "save", "entry": n, "s": secs})
        for n in names:
            target = state(args.scale, mesh, fill=False)
            secs = _timed(LOADS[n], target, paths[n])
            _check(target, args.scale, mesh)
            rows.append({"round": rnd, "op": "restore", "entry": n, "s": secs})
        dist.barrier()
        if args.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    if args.rank == 0:
        print("RESULT " + json.dumps([r for r in rows if r["round"] > 0]), flush=True)
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def table(rows: list[dict[str, Any]]) -> str:
    """Medians per entry point, and the median over rounds of each one's time to DCP's."""
    lines = ["| op | entry point | median s | ratio to dcp+FileSystem (median of rounds) |",
             "|---|---|---|---|"]  # fmt: skip
    for op in ("save", "restore"):
        by = {}
        for r in rows:
            if r["op"] == op:
                by.setdefault(r["entry"], {})[r["round"]] = r["s"]
        for entry, times in by.items():
            ratios = [t / by[BASELINE][k] for k, t in times.items()]
            lines.append(
                f"| {op} | {entry} | {statistics.median(times.values()):.3f} | "
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f}) |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        worker(args)
        return
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
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
        HERE, "results", f"dcp-storage-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "ranks": args.ranks, "scale": args.scale}) + "\n")
    mib = bc.payload_bytes(args.scale) / 2**20
    print(f"{args.ranks} ranks, {mib:.0f} MiB, {args.rounds} rounds ({out})\n")
    print(table(rows))


if __name__ == "__main__":
    main()
