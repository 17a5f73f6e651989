"""One rank of a 2-process CPU (gloo) Accelerate job: train, save_state through
snapshard.accelerate, load it into a model with other weights, compare.

usage: accelerate_ranks.py DIR   (started by tests/multiproc.py; Accelerate reads the layout
from RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, set from it here)
Prints 'RESULT {...}': the distributed type, whether the reload matched, the saved weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator

import snapshard.accelerate as sa
from workers._dist import torch_launch_env


def main() -> None:
    directory = Path(sys.argv[1])
    torch_launch_env()
    accelerator = Accelerator(cpu=True)
    sa.use_snapshard(accelerator)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(x).pow(2).mean())
    opt.step()
    accelerator.save_state(str(directory / "ckpt"))
    want = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    accelerator.load_state(str(directory / "ckpt"))
    same = all(
        torch.equal(v, accelerator.unwrap_model(model).state_dict()[k]) for k, v in want.items()
    )
    files = sorted(p.name for p in (directory / "ckpt").iterdir())
    print("RESULT " + json.dumps({
        "type": str(accelerator.distributed_type), "procs": accelerator.num_processes,
        "same": same, "files": files, "weights": {k: v.tolist() for k, v in want.items()},
    }), flush=True)  # fmt: skip
    accelerator.wait_for_everyone()
    accelerator.end_training()
    os._exit(0)


if __name__ == "__main__":
    main()
