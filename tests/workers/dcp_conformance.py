"""A torch.distributed (gloo, CPU) rank of tests/test_dcp_conformance.py: DCP's storage
scenarios, as PyTorch's own DCP tests put them to FileSystemWriter/Reader, run through
snapshard.torch.StorageWriter/StorageReader.

    dcp_conformance.py save DIR   every rank (2): a state of DTensors (Shard(0), Shard(1),
        Replicate; uneven shards), nested dicts and lists, a plain tensor and objects DCP
        pickles, saved: into DIR/empty (an existing empty directory), to checkpoint_id
        DIR/ckid (writer made without a path), with dcp.async_save on the thread executor
        (DIR/thread, the state changed as soon as it returns) and on the process executor
        (DIR/process), twice through one writer (DIR/reuse-1, DIR/reuse-2), and twice to
        DIR/twice (the second replaces the first). Then every checkpoint is loaded back,
        through one reader for all, into DTensors of other placements.
    dcp_conformance.py load DIR   one rank: every checkpoint loaded into plain tensors, and
        the Shard(0) tensor into a DTensor over a one-device mesh.

Reports, per checkpoint, the full values saved (save) and loaded, as lists; and what DCP
handed the planner as storage_meta at each save.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

import snapshard.torch as sst
from workers._dist import init_torch, report

NAMES = ("empty", "ckid", "thread", "process", "reuse-1", "reuse-2", "twice")
STEPS = {"empty": 1, "ckid": 2, "thread": 3, "process": 4, "reuse-1": 5, "reuse-2": 6, "twice": 8}


class Blob:
    """An object that is no state of torch's: DCP stores it pickled (a BYTE_IO item)."""

    def __init__(self, n: int) -> None:
        self.n = n


class RecordingPlanner(DefaultSavePlanner):
    """DCP's default planner, keeping what DCP passes as storage_meta."""

    seen: list[tuple[str | None, str]] = []

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):  # type: ignore[no-untyped-def]
        assert storage_meta is not None
        cid = None if storage_meta.checkpoint_id is None else str(storage_meta.checkpoint_id)
        RecordingPlanner.seen.append((cid, str(storage_meta.save_id)))
        super().set_up_planner(state_dict, storage_meta, is_coordinator)


def _full(k: int, step: int) -> torch.Tensor:
    return torch.arange(35, dtype=torch.float32).reshape(7, 5) + 100 * k + step


def state(step: int, mesh) -> dict:  # type: ignore[no-untyped-def]
    return {
        "model": {
            "shard0": distribute_tensor(_full(0, step), mesh, [Shard(0)]),  # 4 + 3 rows
            "shard1": distribute_tensor(_full(1, step), mesh, [Shard(1)]),  # 3 + 2 columns
            "repl": distribute_tensor(_full(2, step), mesh, [Replicate()]),
        },
        "optim": {
            "state": {"0": {"exp_avg": torch.full((3,), float(step)), "step": step}},
            "param_groups": [{"lr": 0.1 * step, "params": [0]}],
        },
        "plain": torch.arange(4, dtype=torch.float64) * step,
        "extra": {"blob": Blob(step), "bytes": b"raw-%d" % step, "name": f"run-{step}"},
    }


def target(mesh, placements) -> dict:  # type: ignore[no-untyped-def]
    """A state to load into: zeros, the model's tensors as DTensors of `placements` over
    `mesh`, or plain tensors where `mesh` is None."""

    def zeros(p):  # type: ignore[no-untyped-def]
        z = torch.zeros(7, 5)
        return z if mesh is None else distribute_tensor(z, mesh, [p])

    shard0, shard1, repl = placements
    return {
        "model": {"shard0": zeros(shard0), "shard1": zeros(shard1), "repl": zeros(repl)},
        "optim": {
            "state": {"0": {"exp_avg": torch.zeros(3), "step": 0}},
            "param_groups": [{"lr": 0.0, "params": []}],
        },
        "plain": torch.zeros(4, dtype=torch.float64),
        "extra": {"blob": None, "bytes": b"", "name": ""},
    }


def values(sd: dict) -> dict:
    def full(t):  # type: ignore[no-untyped-def]
        return (t.full_tensor() if isinstance(t, DTensor) else t).tolist()

    st = sd["optim"]["state"]["0"]
    extra = sd["extra"]
    return {
        **{k: full(v) for k, v in sd["model"].items()},
        "exp_avg": full(st["exp_avg"]), "step": st["step"],
        "param_groups": sd["optim"]["param_groups"], "plain": full(sd["plain"]),
        "blob": extra["blob"].n, "bytes": extra["bytes"].decode(), "name": extra["name"],
    }  # fmt: skip


def save(root: str, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where DCP's process finds its store
    mesh = init_device_mesh("cpu", (world,))
    path = {name: os.path.join(root, name) for name in NAMES}
    saved = {name: values(state(STEPS[name], mesh)) for name in NAMES}

    dcp.save(state(STEPS["empty"], mesh), storage_writer=sst.StorageWriter(path["empty"]))
    dcp.save(
        state(STEPS["ckid"], mesh), checkpoint_id=path["ckid"],
        storage_writer=sst.StorageWriter(), planner=RecordingPlanner(),
    )  # fmt: skip

    group = dist.new_group(backend="gloo")  # the background save's own collectives
    live = state(STEPS["thread"], mesh)
    job = dcp.async_save(
        live, storage_writer=sst.StorageWriter(path["thread"]), process_group=group
    )
    live["plain"].add_(1000.0)  # DCP staged a copy before returning
    live["model"]["shard0"].to_local().add_(1000.0)
    job.result()
    dcp.async_save(
        state(STEPS["process"], mesh), storage_writer=sst.StorageWriter(path["process"]),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    ).result()  # fmt: skip

    writer = sst.StorageWriter()  # one instance, two checkpoints (DCP resets it each save)
    for name in ("reuse-1", "reuse-2"):
        dcp.save(
            state(STEPS[name], mesh), checkpoint_id=path[name], storage_writer=writer,
            planner=RecordingPlanner(),
        )  # fmt: skip
    for step in (7, STEPS["twice"]):  # FileSystemWriter's default: the second replaces
        dcp.save(state(step, mesh), storage_writer=sst.StorageWriter(path["twice"]))

    # Loaded back with other placements, through one reader for all of them.
    reader = sst.StorageReader()
    loaded = {}
    for name in NAMES:
        into = target(mesh, (Replicate(), Shard(0), Shard(1)))
        dcp.load(into, checkpoint_id=path[name], storage_reader=reader)
        loaded[name] = values(into)
    return {"saved": saved, "loaded": loaded, "storage_meta": RecordingPlanner.seen}


def load_alone(root: str) -> dict:
    mesh = init_device_mesh("cpu", (1,))
    loaded = {}
    for name in NAMES:
        into = target(None, (None, None, None))
        dcp.load(into, storage_reader=sst.StorageReader(os.path.join(root, name)))
        loaded[name] = values(into)
        one = {"model": {"shard0": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(0)])}}
        dcp.load(one, storage_reader=sst.StorageReader(os.path.join(root, name)))
        loaded[name]["shard0 on one device"] = one["model"]["shard0"].full_tensor().tolist()
    return {"loaded": loaded}


def main() -> None:
    cmd, root = sys.argv[1], sys.argv[2]
    rank, world = init_torch()
    if cmd == "save":
        result = save(root, world)
    elif cmd == "load":
        result = load_alone(root)
    else:
        raise SystemExit(f"unknown command {cmd}")
    dist.barrier()
    report(rank=rank, **result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as torch_job.py: no interpreter teardown after the results are out
