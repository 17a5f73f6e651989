"""torchtitan's checkpoint manager saving beside readers, and loading onto another world size.

usage: titan_beside.py write DIR STOP_FILE
    One process, no process group: a torchtitan manager saves steps 1, 2, ... of a model
    whose weights are all the step's number (and a per-rank data loader) into DIR/ckpt,
    printing 'COMMITTED 1' once the first step is committed, until STOP_FILE exists (at
    least one step); then 'RESULT {...}' with the steps saved and its pid.
usage: titan_beside.py load DIR HELD_ROOT
    A rank of a gloo job (tests/multiproc.py): a load_only manager loads DIR/ckpt (saved by
    one rank) as is, then with exclude_from_loading=["dataloader"]; then a plain manager on
    HELD_ROOT, whose writer lease the test holds, lists and tries to save. Reports each
    outcome.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torchtitan.components.dataloader import ParallelAwareDataloader

from workers._dist import init_torch, leave_torch_job, report


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def build(rank: int, world: int):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    data = [torch.full((4,), float(i)) for i in range(rank, 32, world)]
    loader = ParallelAwareDataloader(data, dp_rank=rank, dp_world_size=world, batch_size=2)
    return model, loader, TrainState()


def manager(directory: str, model, loader, state, **config):
    from snapshard.torchtitan import CheckpointManager

    return CheckpointManager.Config(enable=True, folder="ckpt", **config).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=None,
        lr_schedulers=None,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=directory,
    )


def write(directory: str, stop: str) -> None:
    model, loader, state = build(0, 1)
    mgr = manager(directory, model, loader, state, interval=1, keep_latest_k=10)
    saved = []
    deadline = time.monotonic() + 150
    step = 0
    while step == 0 or (not os.path.exists(stop) and time.monotonic() < deadline):
        step += 1
        state.step = step
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        assert mgr.save(step, last_step=False)
        saved.append(step)
        if step == 1:
            mgr.maybe_wait_for_saving()
            print("COMMITTED 1", flush=True)
        time.sleep(0.1)  # retention deletes a step about a second after its commit
    mgr.maybe_wait_for_saving()
    mgr.close()
    report(saved=saved, pid=os.getpid())


def load(directory: str, held_root: str) -> None:
    import snapshard.torch as sst
    from snapshard.errors import CoordinationError

    rank, world = init_torch()
    model, loader, state = build(rank, world)
    mgr = manager(directory, model, loader, state, load_only=True)
    try:
        mgr.load()
        as_is = {"error": None}
    except Exception as e:
        cause = e.__cause__
        as_is = {"type": type(e).__name__, "error": str(e), "cause": str(cause)}
    mgr.close()
    mgr = manager(
        directory, model, loader, state, load_only=True, exclude_from_loading=["dataloader"]
    )
    loaded = mgr.load()
    values = sorted({float(v) for p in model.parameters() for v in p.detach().flatten()})
    mgr.close()
    beside = sst.CheckpointManager(held_root)  # a reader: the held lease is no obstacle
    steps = beside.all_steps()
    try:
        beside.save(1, {"w": torch.arange(4.0)})
        refused = {"error": None}
    except Exception as e:
        relayed = isinstance(e, CoordinationError)
        refused = {"type": type(e).__name__, "error": str(e), "relayed": relayed}
    beside.close()
    report(
        rank=rank,
        as_is=as_is,
        loaded=loaded,
        step=state.step,
        values=values,
        steps=steps,
        refused=refused,
    )
    leave_torch_job(rank)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3])
    else:
        load(sys.argv[2], sys.argv[3])
