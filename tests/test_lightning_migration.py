"""Switching a running Lightning job to snapshard.lightning: a fit resumes from the `.ckpt`
file Lightning wrote before the switch and the next save replaces it in one step; a module
comes back from a snapshard checkpoint with `load_from_checkpoint`, and
`to_lightning_file` goes back to Lightning's own format."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

import multiproc  # noqa: E402
import snapshard.lightning as sl  # noqa: E402
import snapshard.torch as sst  # noqa: E402
from snapshard.storage import atomic_rename  # noqa: E402

ROOT = Path(__file__).parent.parent
SWITCH = Path(__file__).parent / "workers" / "lightning_switch.py"

STEPS_PER_EPOCH = 4


class Model(L.LightningModule):
    def __init__(self, width: int = 8, name: str = "mlp"):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
        )

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


class StartStep(Callback):
    """The global step a fit starts at: a resumed fit starts after its checkpoint's."""

    start = -1

    def on_train_start(self, trainer, *_):
        self.start = trainer.global_step


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=False)


def fit(directory: Path, epochs: int, plugins: list, ckpt_path: Path | None = None, **trainer):
    """A fit of a fresh Model (same initial weights every time), checkpointing into
    `directory` with ModelCheckpoint(save_last=True); returns the model and its start step."""
    torch.manual_seed(1)
    started = StartStep()
    t = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, plugins=plugins, logger=False,
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True), started],
        enable_progress_bar=False, enable_model_summary=False, deterministic=True, **trainer,
    )  # fmt: skip
    model = Model()
    t.fit(model, data(), ckpt_path=ckpt_path)
    return model, started.start


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    want, got = a.state_dict(), b.state_dict()
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert torch.equal(v, got[k]), k


def is_snapshard_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "manifest.json").is_file()


@pytest.mark.parametrize("wrapped", [False, True], ids=["CheckpointIO", "AsyncCheckpointIO"])
def test_fit_resumes_from_lightning_file_and_replaces_it(tmp_path, wrapped):
    straight, _ = fit(tmp_path / "straight", 2, [])
    fit(tmp_path / "run", 1, [])  # Lightning's own CheckpointIO: .ckpt files
    old = tmp_path / "run" / "last.ckpt"
    assert old.is_file()
    io = sl.CheckpointIO()
    plugin = sl.AsyncCheckpointIO(io) if wrapped else io
    after, start = fit(tmp_path / "run", 2, [plugin], ckpt_path=old)
    assert start == STEPS_PER_EPOCH  # resumed after the first epoch, not from scratch
    assert_same_weights(straight, after)
    # the next saves are snapshard checkpoints: last.ckpt replaced, the old epoch file removed
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == [f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt", "last.ckpt"], names
    assert all(is_snapshard_checkpoint(tmp_path / "run" / n) for n in names)
    assert sst.load(old)["global_step"] == 2 * STEPS_PER_EPOCH


def lightning_file(path: Path, **extra) -> dict:
    """A checkpoint file as Lightning's own CheckpointIO writes it."""
    checkpoint = {"state_dict": {"w": torch.arange(4.0)}, "epoch": 3, **extra}
    TorchCheckpointIO().save_checkpoint(checkpoint, path)
    return checkpoint


class Opaque:
    def __init__(self, n: int):
        self.n = n


def test_objects_beyond_weights_only_in_a_lightning_file_need_trust_pickle(tmp_path):
    path = tmp_path / "old.ckpt"
    lightning_file(path, custom=Opaque(5))
    with pytest.raises(sl.UntrustedPickleError, match=r"old\.ckpt: .*Opaque.*trust_pickle=True"):
        sl.CheckpointIO().load_checkpoint(path)
    with pytest.raises(sl.UntrustedPickleError, match=r"old\.ckpt"):
        sl.CheckpointIO(trust_pickle=True).load_checkpoint(path, weights_only=True)
    back = sl.CheckpointIO(trust_pickle=True).load_checkpoint(path, map_location="cpu")
    assert back["custom"].n == 5 and back["epoch"] == 3
    assert torch.equal(back["state_dict"]["w"], torch.arange(4.0))


def test_a_lightning_file_at_a_url_loads_where_no_snapshard_checkpoint_is():
    # fsspec's memory filesystem, as Lightning writes URLs; snapshard's memory:// store has
    # no checkpoint at that name, so the file is what the path names
    url = "memory://lightning-migration/old.ckpt"
    lightning_file(url)
    back = sl.CheckpointIO().load_checkpoint(url)
    assert back["epoch"] == 3 and torch.equal(back["state_dict"]["w"], torch.arange(4.0))
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt"):
        sl.CheckpointIO().load_checkpoint("memory://lightning-migration/missing.ckpt")


def test_a_failed_save_leaves_the_lightning_file_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    lightning_file(path)
    with pytest.raises(Exception, match="complex32"):  # a dtype snapshard cannot store
        sl.CheckpointIO().save_checkpoint({"w": torch.zeros(2, dtype=torch.complex32)}, path)
    assert path.is_file() and sl.CheckpointIO().load_checkpoint(path)["epoch"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_replacing_a_lightning_file_without_the_kernel_exchange(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic_rename, "_exchange", lambda a, b: False)
    path = tmp_path / "last.ckpt"
    lightning_file(path)
    sl.CheckpointIO().save_checkpoint({"epoch": 4, "w": torch.ones(2)}, path)
    assert is_snapshard_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert sl.CheckpointIO().load_checkpoint(path)["epoch"] == 4


def trained(tmp_path: Path, **hparams) -> tuple[Model, Path]:
    """A Model trained one step with the plugin, its checkpoint a snapshard checkpoint."""
    torch.manual_seed(2)
    model = Model(**hparams)
    t = L.Trainer(
        max_steps=1, accelerator="cpu", devices=1, plugins=[sl.CheckpointIO()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    t.fit(model, data())
    path = tmp_path / "one-step.ckpt"
    t.save_checkpoint(path)
    assert is_snapshard_checkpoint(path)
    return model, path


def test_load_from_checkpoint_gives_the_module_with_its_weights_and_hparams(tmp_path):
    model, path = trained(tmp_path, width=6, name="small")
    with pytest.raises(IsADirectoryError):  # why the function exists
        Model.load_from_checkpoint(path)
    back = sl.load_from_checkpoint(Model, path)
    assert type(back) is Model and not torch.equal(back.net[0].weight, Model(6).net[0].weight)
    assert dict(back.hparams) == {"width": 6, "name": "small"}
    assert_same_weights(model, back)
    # keyword arguments override the saved hyper-parameters, as in Lightning's
    renamed = sl.load_from_checkpoint(Model, path, map_location="cpu", name="renamed")
    assert dict(renamed.hparams) == {"width": 6, "name": "renamed"}
    # strict: a module of another width does not take the weights
    with pytest.raises(RuntimeError, match="size mismatch"):
        sl.load_from_checkpoint(Model, path, width=5)
    with pytest.raises(TypeError, match="not a LightningModule class"):
        sl.load_from_checkpoint(torch.nn.Linear, path)


def test_load_from_checkpoint_reads_hparams_file_and_lightning_files(tmp_path):
    model, path = trained(tmp_path, width=6)
    hparams = tmp_path / "hparams.yaml"
    hparams.write_text("width: 6\nname: from-yaml\n")
    back = sl.load_from_checkpoint(Model, path, hparams_file=hparams)
    assert back.hparams["name"] == "from-yaml"
    assert_same_weights(model, back)
    with pytest.raises(ValueError, match=r"hparams\.txt: hparams_file must be"):
        sl.load_from_checkpoint(Model, path, hparams_file=tmp_path / "hparams.txt")
    # a file Lightning wrote itself loads the same way
    TorchCheckpointIO().save_checkpoint(sl.CheckpointIO().load_checkpoint(path), tmp_path / "f")
    assert_same_weights(model, sl.load_from_checkpoint(Model, tmp_path / "f"))


def test_load_from_checkpoint_of_a_strategys_sharded_checkpoint(tmp_path):
    torch.manual_seed(3)
    model = Model(width=5)
    path = str(tmp_path / "sharded.ckpt")
    checkpoint = {
        "state_dict": model.state_dict(), "epoch": 1, "global_step": 7,
        "hyper_parameters": dict(model.hparams), "hparams_name": "kwargs",
        "pytorch-lightning_version": L.__version__,
    }  # fmt: skip
    sl.save_sharded(path, checkpoint, rank=0)  # the strategies' layout, one process
    back = sl.load_from_checkpoint(Model, path)
    assert dict(back.hparams) == {"width": 5, "name": "mlp"}
    assert_same_weights(model, back)
    # and back to a Lightning file, which Lightning's own loader reads
    out = tmp_path / "weights.ckpt"
    sl.to_lightning_file(path, out)
    assert_same_weights(model, Model.load_from_checkpoint(out))


def test_to_lightning_file_gives_a_file_lightning_resumes_from(tmp_path):
    straight, _ = fit(tmp_path / "straight", 2, [])
    fit(tmp_path / "run", 1, [sl.CheckpointIO()])
    last = tmp_path / "run" / "last.ckpt"
    assert is_snapshard_checkpoint(last)
    out = tmp_path / "back" / "last.ckpt"
    out.parent.mkdir()
    sl.to_lightning_file(last, out)
    assert out.is_file() and sorted(p.name for p in out.parent.iterdir()) == ["last.ckpt"]
    after, start = fit(tmp_path / "back", 2, [], ckpt_path=out)  # Lightning's own IO
    assert start == STEPS_PER_EPOCH
    assert_same_weights(straight, after)


def test_to_lightning_file_refuses_pickled_entries_unless_trusted(tmp_path):
    path = tmp_path / "ckpt"
    sl.CheckpointIO().save_checkpoint({"state_dict": {}, "custom": Opaque(2)}, path)
    out = tmp_path / "out.ckpt"
    with pytest.raises(sl.UntrustedPickleError, match="/custom"):
        sl.to_lightning_file(path, out)
    assert not out.exists()
    sl.to_lightning_file(path, out, trust_pickle=True)
    assert torch.load(out, weights_only=False)["custom"].n == 2


@pytest.mark.slow
def test_sharded_strategy_resumes_from_lightnings_own_checkpoint_and_replaces_it(tmp_path):
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"),
        "MASTER_PORT": str(multiproc.free_port()),
    }  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, str(SWITCH), str(tmp_path), str(tmp_path / "out.pt")], env=env,
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        output, _ = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        output = "ran past 240 s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
    assert p.returncode == 0, output[-4000:]
    runs = torch.load(tmp_path / "out.pt")
    straight, switched = runs["straight"], runs["switched"]
    assert straight["start"] == (0, 0) and switched["start"] == (8, 1)  # resumed, epoch 1
    assert switched["weights"].keys() == straight["weights"].keys()
    for k, v in straight["weights"].items():
        assert torch.equal(v, switched["weights"][k]), k
    # Lightning's DCP directories were replaced by snapshard checkpoints
    run = tmp_path / "run"
    names = sorted(p.name for p in run.iterdir())
    assert names == ["epoch=1-step=16.ckpt", "last.ckpt"], names
    assert all(is_snapshard_checkpoint(run / n) for n in names)
