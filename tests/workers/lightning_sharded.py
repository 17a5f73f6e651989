"""A Lightning fit on 2 CPU processes with FSDP2 (ModelParallelStrategy), its sharded
checkpoints written by snapshard.lightning.ModelParallelStrategy.

usage: lightning_sharded.py MODE DIR OUT
   MODE 'full':   fit EPOCHS epochs; rank 0 writes the final full weights and the
                  (step, epoch) the fit started at to OUT (torch.save).
   MODE 'kill':   fit; once the first epoch's checkpoint is committed, rank 0 writes OUT (a
                  marker) and both ranks train slowly until the parent SIGKILLs them.
   MODE 'resume': fit from DIR/last.ckpt to EPOCHS epochs, then as 'full'.
Lightning starts the second process itself (its subprocess launcher re-runs this script).
ModelCheckpoint(save_top_k=1 by train_loss, save_last=True) writes into DIR.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_train import KillPoint, StartStep, data  # the same data, start and kill point
from torch.distributed.fsdp import fully_shard

import snapshard.lightning

EPOCHS = 3


class Model(L.LightningModule):
    def __init__(self, width: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.width = width

    def configure_model(self) -> None:
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, self.width), torch.nn.Tanh(), torch.nn.Linear(self.width, 1)
        )
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def main() -> None:
    mode, directory, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.manual_seed(1)
    torch.use_deterministic_algorithms(True)
    started = StartStep()
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=directory, monitor="train_loss", save_top_k=1, save_last=True),
        started,
    ]
    if mode == "kill":
        callbacks.append(KillPoint(directory, out))
    strategy = snapshard.lightning.ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1
    )
    trainer = L.Trainer(
        max_epochs=EPOCHS if mode != "kill" else 100, accelerator="cpu", devices=2,
        strategy=strategy, callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )  # fmt: skip
    model = Model()
    ckpt = str(directory / "last.ckpt") if mode == "resume" else None
    trainer.fit(model, data(), ckpt_path=ckpt)
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    if trainer.global_rank == 0:
        torch.save({"weights": weights, "start": started.start}, out)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
