"""A torch.distributed (gloo, CPU) rank of the tests of snapshard.torch.StorageWriter and
StorageReader, DCP's storage interfaces over snapshard's format.

    torch_dcp_job.py save DIR   every rank: FSDP2 model + Adam state, a plain tensor, plain
                                values and a BYTE_IO object, written three ways: dcp.save and
                                dcp.async_save through snapshard.torch.StorageWriter (DIR/dcp,
                                DIR/async), and snapshard.torch.save (DIR/sst)
    torch_dcp_job.py load DIR   every rank: a fresh FSDP2 model over this world size filled
                                from each of them with dcp.load through StorageReader, and from
                                DIR/dcp with snapshard.torch.load (tensors and plain values)
    torch_dcp_job.py process DIR  every rank: dcp.async_save in DCP's checkpointing process
                                (AsyncCheckpointerType.PROCESS) to DIR/process, then
                                dcp.load of it into a fresh model
    torch_dcp_job.py fail DIR   every rank: dcp.save to DIR/failed with rank 1's data file
                                writes failing; reports each rank's error

Reports, per state, the sha256 of every entry's full value: the test compares them.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import snapshard.torch as sst
from workers._dist import init_torch, report
from workers.torch_job import build, digests, train


def state_of(model, opt, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {
        "model": msd,
        "optim": osd,
        "step": step,
        "plain": torch.arange(6, dtype=torch.float32) * step,
        "loader": {"epoch": 2, "seen": ["a", "b"], "weights": (0.5, 0.25)},  # DCP pickles these
    }


def save(root: str, world: int) -> dict:
    model, opt = build("1d", world)
    train(model, opt, 2, seed=1)
    state = state_of(model, opt, 2)
    saved = digests(state)
    dcp.save(state, storage_writer=sst.StorageWriter(os.path.join(root, "dcp")))
    sst.save(os.path.join(root, "sst"), {k: v for k, v in state.items() if k != "loader"})
    # The background save's collectives get their own group: training goes on meanwhile.
    group = dist.new_group(backend="gloo")
    writer = sst.StorageWriter(os.path.join(root, "async"))
    job = dcp.async_save(state, storage_writer=writer, process_group=group)
    train(model, opt, 1, seed=2)  # DCP staged the state before returning
    job.result()
    return {"saved": saved, "after": digests(state_of(model, opt, 3))}


def fresh(world: int):
    model, opt = build("1d", world)
    train(model, opt, 1, seed=9)  # Adam state exists, with other values
    return model, opt


def load(root: str, world: int) -> dict:
    out = {}
    for name in ("dcp", "async", "sst"):
        model, opt = fresh(world)
        target = state_of(model, opt, 0)
        target["plain"] = torch.zeros(6)
        target["loader"] = {"epoch": 0, "seen": [], "weights": ()}
        if name == "sst":
            del target["loader"]
        dcp.load(target, storage_reader=sst.StorageReader(os.path.join(root, name)))
        set_state_dict(
            model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
        msd, osd = get_state_dict(model, opt)
        out[name] = digests({**target, "model": msd, "optim": osd})
    # snapshard's own loader: tensors and plain values (DCP's pickled entries stay out)
    model, opt = fresh(world)
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": {"state": osd["state"]}, "step": 0, "plain": torch.zeros(6)}
    sst.load(os.path.join(root, "dcp"), target)
    out["sst.load"] = digests(target)
    return out


def in_a_process(root: str, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where DCP's process finds its store
    model, opt = build("1d", world)
    train(model, opt, 2, seed=1)
    state = state_of(model, opt, 2)
    saved = digests(state)
    writer = sst.StorageWriter(os.path.join(root, "process"))
    kind = AsyncCheckpointerType.PROCESS
    dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind).result()
    model, opt = fresh(world)
    target = state_of(model, opt, 0)
    target["plain"] = torch.zeros(6)
    target["loader"] = {"epoch": 0, "seen": [], "weights": ()}
    dcp.load(target, storage_reader=sst.StorageReader(os.path.join(root, "process")))
    return {"saved": saved, "loaded": digests(target)}


def fail(root: str, rank: int) -> dict:
    from snapshard.storage import local

    if rank == 1:

        def open_writer(self, name):
            raise OSError(28, f"injected: no space left for {name} on rank {rank}")

        local.LocalStorage.open_writer = open_writer
    model, opt = build("1d", dist.get_world_size())
    state = state_of(model, opt, 1)
    path = os.path.join(root, "failed")
    try:
        dcp.save(state, storage_writer=sst.StorageWriter(path))
        error = None
    except CheckpointException as e:  # DCP's error for a step that failed on some rank
        error = str(e)
    dist.barrier()
    return {"error": error, "committed": os.path.exists(os.path.join(path, "manifest.json"))}


def main() -> None:
    cmd, root = sys.argv[1], sys.argv[2]
    rank, world = init_torch()
    if cmd == "save":
        result = save(root, world)
    elif cmd == "load":
        result = load(root, world)
    elif cmd == "process":
        result = in_a_process(root, world)
    elif cmd == "fail":
        result = fail(root, rank)
    else:
        raise SystemExit(f"unknown command {cmd}")
    dist.barrier()
    report(rank=rank, **result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as torch_job.py: no interpreter teardown after the results are out
