"""One rank of 2 gloo CPU ranks: an FSDP1 model's sharded state, as Lightning's
FSDPStrategy collects it (`lightning_module_state_dict`, `optimizer_state`: ShardedTensors),
saved with snapshard.lightning.save_sharded and loaded back with load_sharded into a
model whose weights were changed. (Lightning's Trainer runs FSDPStrategy on GPUs only.)

usage: lightning_fsdp1.py DIR   (started by tests/multiproc.py)
Prints 'RESULT {...}': whether weights and optimizer state came back, the rest of the dict.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import snapshard.lightning as sl


def main() -> None:
    path = sys.argv[1]
    rank = int(os.environ["SNAPSHARD_TEST_PROCESS_ID"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['SNAPSHARD_TEST_PORT']}",
        rank=rank, world_size=int(os.environ["SNAPSHARD_TEST_NUM_PROCESSES"]),
    )  # fmt: skip
    torch.manual_seed(0)
    model = FSDP(torch.nn.Linear(6, 4), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    strategy = sl.FSDPStrategy(state_dict_type="sharded")
    strategy.model = model
    checkpoint = {
        "state_dict": strategy.lightning_module_state_dict(),
        "optimizer_states": [strategy.optimizer_state(opt)],
        "epoch": 3,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": 7}}},
    }
    kinds = sorted({type(v).__name__ for v in checkpoint["state_dict"].values()})
    sl.save_sharded(path, checkpoint, rank)
    with FSDP.summon_full_params(model):
        want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = {k: v["exp_avg"].clone() for k, v in opt.state_dict()["state"].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for state in opt.state.values():
        state["exp_avg"].zero_()
    rest = sl.load_sharded(path, model, [opt])
    with FSDP.summon_full_params(model):
        weights_back = all(torch.equal(v, model.state_dict()[k]) for k, v in want.items())
    opt_back = all(
        torch.equal(v, opt.state_dict()["state"][k]["exp_avg"]) for k, v in want_opt.items()
    )
    print("RESULT " + json.dumps({
        "kinds": kinds, "weights": weights_back, "optimizer": opt_back, "rest": rest,
    }), flush=True)  # fmt: skip
    dist.barrier()
    os._exit(0)  # gloo's threads may abort an ordinary interpreter exit


if __name__ == "__main__":
    main()
