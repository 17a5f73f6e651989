"""A rank of a job that tests/test_dcp_exit.py starts under torchrun (2 ranks, gloo, CPU):
the program a user writes to resume from a checkpoint, run to its normal end.

    dcp_resume.py save DIR   dcp.save of `state()` through snapshard.torch.StorageWriter
    dcp_resume.py load DIR   dcp.load of DIR into a fresh target through StorageReader,
                             checked against `state()`

Both end as a program should: `destroy_process_group()`, then the interpreter's own exit
(no os._exit). Before that, each checks that snapshard left no thread running. Prints
`OK <rank>` once its work is checked.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import snapshard.torch as sst


def state(fill: float | None = None) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = torch.arange(128 * 32, dtype=torch.float32).reshape(128, 32)
    b = torch.linspace(-1, 1, 100)
    if fill is not None:
        w, b = torch.full_like(w, fill), torch.full_like(b, fill)
    return {"model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": b}, "step": 7}


def main() -> None:
    cmd, root = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if cmd == "save":
        dcp.save(state(), storage_writer=sst.StorageWriter(root))
    else:
        target, want = state(fill=0.0), state()
        dcp.load(target, storage_reader=sst.StorageReader(root))
        assert torch.equal(target["model"]["w"].full_tensor(), want["model"]["w"].full_tensor())
        assert torch.equal(target["model"]["b"], want["model"]["b"])
        assert target["step"] == 7
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    assert not left, f"threads left running: {left}"
    print(f"OK {dist.get_rank()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
