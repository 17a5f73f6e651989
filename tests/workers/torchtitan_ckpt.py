"""torchtitan's classes checkpointed through snapshard.torchtitan.CheckpointManager, on gloo.

usage: torchtitan_ckpt.py DIR
Every rank builds an FSDP2 model (ModelWrapper), an OptimizersContainer (AdamW), an
LRSchedulersContainer-like Stateful and a ParallelAwareDataloader over its own share of the
data, trains 4 steps with saves at interval 2 (keep_latest_k=2) through the trainer's order
of calls (maybe_wait_for_staging before optimizers.step, save after the step), then a second
manager on fresh objects loads the latest step and reports what it got against the values
at save time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from snapshard.torchtitan import CheckpointManager
from workers._dist import init_torch, leave_torch_job, report


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


def build(rank: int, world: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(model)
    opt = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
        ],
    ).build(model_parts=[model])
    data = [torch.full((8,), float(i)) for i in range(rank, 64, world)]
    loader = ParallelAwareDataloader(data, dp_rank=rank, dp_world_size=world, batch_size=2)
    return model, opt, loader, TrainState()


def manager(directory: str, model, opt, loader, train_state) -> CheckpointManager:
    config = CheckpointManager.Config(enable=True, folder="ckpt", interval=2, keep_latest_k=2)
    return config.build(
        dataloader=loader,
        model_parts=[model],
        optimizers=opt,
        lr_schedulers=None,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=directory,
    )


def local(sd: dict) -> dict:
    return {k: v.to_local().clone() for k, v in sd.items()}


def main() -> None:
    directory = sys.argv[1]
    rank, world = init_torch()
    model, opt, loader, ts = build(rank, world)
    mgr = manager(directory, model, opt, loader, ts)
    assert mgr.load() is False  # nothing there yet
    it = iter(loader)
    saved = []
    for step in range(1, 5):
        ts.step = step
        model(next(it)).square().mean().backward()
        mgr.maybe_wait_for_staging()
        opt.step()
        opt.zero_grad()
        saved.append(mgr.save(step, last_step=False))
        if step == 4:  # what step 4 saved
            want = local(model.state_dict())
            want_next = next(it).tolist()  # the batch after step 4
    mgr.maybe_wait_for_saving()
    mgr.close()
    steps = sorted(int(p.name) for p in Path(directory, "ckpt").iterdir() if p.name.isdigit())

    model2, opt2, loader2, ts2 = build(rank, world)
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    mgr2 = manager(directory, model2, opt2, loader2, ts2)
    loaded = mgr2.load()
    got = local(model2.state_dict())
    same = all(torch.equal(got[k], want[k]) for k in want)
    opt_sd = opt2.state_dict()
    exp_avg = [k for k in opt_sd if "exp_avg" in k]
    batch = next(iter(loader2)).tolist()
    mgr2.close()
    report(
        rank=rank,
        saved=saved,
        steps=steps,
        loaded=loaded,
        step=ts2.step,
        same=same,
        exp_avg=len(exp_avg),
        batch=batch,
        want_batch=want_next,
    )
    dist.barrier()
    leave_torch_job(rank)


if __name__ == "__main__":
    main()
