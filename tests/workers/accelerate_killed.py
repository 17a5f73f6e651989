"""An Accelerate job whose second save_state is killed after snapshard's hook.

usage: accelerate_killed.py PROJECT_DIR
Accelerate's automatic checkpoint naming: save_state() writes checkpoints/checkpoint_0
whole, then, after one more step, checkpoints/checkpoint_1 until the custom object's state
(the last part Accelerate writes) is asked for: the process exits there (os._exit(3)), with
the weights and the optimizer of checkpoint_1 already written.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import snapshard.accelerate as sa


class Counter:
    """A custom object registered for checkpointing; its state is written last."""

    def __init__(self) -> None:
        self.n, self.die = 0, False

    def state_dict(self) -> dict[str, int]:
        if self.die:
            os._exit(3)
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def main() -> None:
    config = ProjectConfiguration(project_dir=sys.argv[1], automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    sa.use_snapshard(accelerator)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    for step in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        accelerator.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
        counter.n, counter.die = step + 1, step == 1
        accelerator.save_state()
    sys.exit("the second save_state finished; it was to be killed")


if __name__ == "__main__":
    main()
