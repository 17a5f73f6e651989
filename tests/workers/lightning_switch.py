"""A Lightning fit with FSDP2 (ModelParallelStrategy) on one CPU process whose run switches
to snapshard: its first epoch checkpointed by Lightning's own strategy (DCP files and
meta.pt), the rest by snapshard.lightning.ModelParallelStrategy resuming from Lightning's
last.ckpt; and, for reference, the same fit straight through with snapshard's strategy.

usage: lightning_switch.py DIR OUT
The switched run checkpoints into DIR/run, the straight one into DIR/straight (both with
ModelCheckpoint(save_last=True)). OUT (torch.save) gets each run's final weights and the
(step, epoch) it started at: {"straight": {...}, "switched": {...}}.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning_sharded import Model
from lightning_train import StartStep, data

import snapshard.lightning

EPOCHS = 2


def fit(strategy: type, directory: Path, epochs: int, resume: bool) -> dict[str, Any]:
    """One fit of a fresh model (the same initial weights each time) on a new Trainer."""
    torch.manual_seed(1)
    started = StartStep()
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=directory, save_last=True), started]
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1,
        strategy=strategy(data_parallel_size=1, tensor_parallel_size=1),
        callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )  # fmt: skip
    model = Model()
    trainer.fit(model, data(), ckpt_path=str(directory / "last.ckpt") if resume else None)
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "start": started.start}


def main() -> None:
    directory, out = Path(sys.argv[1]), sys.argv[2]
    torch.use_deterministic_algorithms(True)
    ours = snapshard.lightning.ModelParallelStrategy
    straight = fit(ours, directory / "straight", EPOCHS, resume=False)
    fit(ModelParallelStrategy, directory / "run", 1, resume=False)  # before the switch
    switched = fit(ours, directory / "run", EPOCHS, resume=True)
    torch.save({"straight": straight, "switched": switched}, out)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
