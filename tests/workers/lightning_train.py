"""A small Lightning fit on CPU that checkpoints through snapshard.lightning.CheckpointIO.

usage: lightning_train.py MODE DIR OUT
   MODE 'full':   fit EPOCHS epochs, write the final weights and the
                  (step, epoch) the fit started at to OUT (torch.save).
   MODE 'kill':   fit; once the first epoch's checkpoint is committed, write OUT (a marker)
                  and keep training slowly until the parent SIGKILLs this process.
   MODE 'resume': fit from DIR/last.ckpt to EPOCHS epochs, write the final weights to OUT.
Under torchrun, the fit is DDP over its ranks (Lightning saves on rank 0 alone).
Checkpoints go through snapshard.lightning's AsyncCheckpointIO(CheckpointIO()) with ModelCheckpoint
(save_top_k=1 by train_loss, save_last=True) into DIR.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import snapshard.lightning

EPOCHS = int(os.environ.get("LIGHTNING_TEST_EPOCHS", "3"))


class Model(L.LightningModule):
    def __init__(self, width: int = 8):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False
    )


class StartStep(Callback):
    """Records the step and epoch the fit starts at (a resumed fit starts after the
    checkpoint's)."""

    start: tuple[int, int] = (-1, -1)

    def on_train_start(self, trainer, *_):
        self.start = (trainer.global_step, trainer.current_epoch)


class KillPoint(Callback):
    """In 'kill' mode: from the second epoch on, wait for the first epoch's checkpoint to be
    committed, tell the parent (rank 0 does), and slow down until killed."""

    def __init__(self, directory: Path, marker: Path):
        self.directory, self.marker = directory, marker

    def on_train_batch_start(self, trainer, *_):
        if trainer.current_epoch < 1:
            return
        deadline = time.monotonic() + 60
        while not (self.directory / "last.ckpt" / "manifest.json").exists():
            if time.monotonic() > deadline:
                raise SystemExit("the first checkpoint never appeared")
            time.sleep(0.05)
        if trainer.global_rank == 0 and not self.marker.exists():  # one writer of several ranks
            self.marker.write_text("checkpointed")
        time.sleep(0.2)


def main() -> None:
    mode, directory, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.manual_seed(1)
    torch.use_deterministic_algorithms(True)
    callbacks: list[Callback] = [
        ModelCheckpoint(dirpath=directory, monitor="train_loss", save_top_k=1, save_last=True)
    ]
    started = StartStep()
    callbacks.append(started)
    if mode == "kill":
        callbacks.append(KillPoint(directory, out))
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun: DDP over its ranks
    trainer = L.Trainer(
        max_epochs=EPOCHS if mode != "kill" else 100, accelerator="cpu", devices=ranks,
        strategy="ddp" if ranks > 1 else "auto",
        plugins=[snapshard.lightning.AsyncCheckpointIO(snapshard.lightning.CheckpointIO())],
        callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True,
    )  # fmt: skip
    model = Model()
    ckpt = str(directory / "last.ckpt") if mode == "resume" else None
    trainer.fit(model, data(), ckpt_path=ckpt)
    if mode != "kill" and trainer.global_rank == 0:
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save({"weights": weights, "start": started.start}, out)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
