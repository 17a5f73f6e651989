"""A torch.distributed (gloo, CPU) rank of tests/test_dcp_corrupt_load.py (2 ranks).

    dcp_corrupt.py save DIR   every rank: dcp.save of `state()` through
                              snapshard.torch.StorageWriter into DIR
    dcp_corrupt.py load DIR...   every rank: dcp.load of each DIR in turn into a fresh
                              target through snapshard.torch.StorageReader; reports what
                              it raised, with "root": DIR

`model.w` is sharded by rows over the ranks (each reads its own half), `b` is a plain tensor
every rank reads whole. Reports, per rank, the type and the text of the error the user sees
(DCP's CheckpointException, which carries the failing ranks' errors), or none.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import snapshard.torch as sst
from workers._dist import init_torch, leave_torch_job, report


def state(world: int, fill: float | None = None) -> dict:
    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    b = torch.linspace(-1, 1, 32)
    if fill is not None:
        w, b = torch.full_like(w, fill), torch.full_like(b, fill)
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)])}, "b": b}


def main() -> None:
    cmd, roots = sys.argv[1], sys.argv[2:]
    rank, world = init_torch()
    if cmd == "save":
        dcp.save(state(world), storage_writer=sst.StorageWriter(roots[0]))
        report(rank=rank)
    elif cmd == "load":
        for root in roots:
            try:
                dcp.load(state(world, fill=0.0), storage_reader=sst.StorageReader(root))
                report(rank=rank, root=root, error=None)
            except (CheckpointException, Exception) as e:  # DCP's is a BaseException
                report(rank=rank, root=root, error=type(e).__name__, text=str(e))
    else:
        raise SystemExit(f"unknown command {cmd}")
    leave_torch_job(rank)


if __name__ == "__main__":
    main()
