"""One rank of 2 gloo CPU ranks: FSDP2 (`fully_shard`) model and optimizer state through
the FSDP functions snapshard.accelerate installs (`save_fsdp_model`, `load_fsdp_model`,
`save_fsdp_optimizer`, `load_fsdp_optimizer`, where Accelerate's `save_state` looks them
up), with a real Accelerator and FullyShardedDataParallelPlugin. Accelerate itself runs
FSDP on GPUs only, so the functions are called as save_state/load_state call them.

usage: accelerate_fsdp.py DIR   (started by tests/multiproc.py)
Prints 'RESULT {...}': the files written, whether weights and optimizer state came back,
and what an accelerator without the switch wrote.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import fully_shard

import snapshard.accelerate as sa
from workers._dist import torch_launch_env


def main() -> None:
    directory = Path(sys.argv[1])
    torch_launch_env()
    accelerator = Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    sa.use_snapshard(accelerator)
    fsdp = sa.fsdp_functions()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    out = str(directory / "ckpt")
    fsdp["save_fsdp_model"](plugin, accelerator, model, out, 0)
    fsdp["save_fsdp_optimizer"](plugin, accelerator, opt, model, out, 0)
    want = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    want_opt = [s["exp_avg"].full_tensor().clone() for s in opt.state.values()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for s in opt.state.values():
        s["exp_avg"].zero_()
    fsdp["load_fsdp_model"](plugin, accelerator, model, out, 0)
    fsdp["load_fsdp_optimizer"](plugin, accelerator, opt, model, out, 0)
    weights = all(torch.equal(v, model.state_dict()[k].full_tensor()) for k, v in want.items())
    optimizer = all(
        torch.equal(w, s["exp_avg"].full_tensor())
        for w, s in zip(want_opt, opt.state.values(), strict=True)
    )
    sa.stop_using(accelerator)  # Accelerate's own functions again: DCP's FileSystemWriter
    own = str(directory / "own")
    fsdp["save_fsdp_model"](plugin, accelerator, model, own, 0)
    accelerator.wait_for_everyone()
    print("RESULT " + json.dumps({
        "files": sorted(os.listdir(out)), "weights": weights, "optimizer": optimizer,
        "own": sorted(os.listdir(os.path.join(own, "pytorch_model_fsdp_0"))),
    }), flush=True)  # fmt: skip
    accelerator.wait_for_everyone()
    os._exit(0)


if __name__ == "__main__":
    main()
