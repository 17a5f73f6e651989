"""snapshard.accelerate: a state directory whose save_state did not finish is refused by
load_state before any model is touched; the others load; and the `accelerate launch --cpu`
pitfall is named. With a real Accelerator on CPU; the killed save is a real process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import snapshard  # noqa: E402
import snapshard.accelerate as sa  # noqa: E402
import snapshard.torch as sst  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "accelerate_killed.py"
SRC = Path(__file__).parent.parent / "src"


class Counter:
    def __init__(self, fail: bool = False) -> None:
        self.n, self.fail = 0, fail

    def state_dict(self) -> dict[str, int]:
        if self.fail:
            raise RuntimeError("the custom object's state could not be taken (injected)")
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def setup(seed: int, project: Path | None = None):
    torch.manual_seed(seed)
    config = None
    if project is not None:
        config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True)
    accelerator = Accelerator(cpu=True, project_config=config)
    sa.use_snapshard(accelerator)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, counter


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def markers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(sa.INCOMPLETE))


def test_a_save_state_killed_after_the_hook_is_refused_and_the_model_untouched(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    r = subprocess.run([sys.executable, str(WORKER), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    killed, whole = checkpoints / "checkpoint_1", checkpoints / "checkpoint_0"
    # the weights and the optimizer were written, the custom object's state was not
    assert {sa.NAME, "optimizer.bin"} <= {p.name for p in killed.iterdir()}
    assert not (killed / "custom_checkpoint_0.pkl").exists()
    assert markers(killed) == [f"{sa.INCOMPLETE}0"] and markers(whole) == []

    accelerator, model, counter = setup(1, tmp_path)  # other initial weights
    before = weights(model)
    with pytest.raises(snapshard.CheckpointNotFoundError) as e:
        accelerator.load_state()  # automatic naming picks the newest folder: the killed one
    text = str(e.value)
    assert str(killed) in text and "incomplete" in text and "unchanged" in text
    assert f"accelerator.load_state('{whole}')" in text  # the newest complete one, named
    assert same(weights(model), before) and counter.n == 0

    accelerator.load_state(str(whole))
    target = {"model_0": {k: torch.empty_like(v) for k, v in before.items()}}
    saved = sst.load(whole / sa.NAME, target)["model_0"]
    assert same(weights(model), saved) and not same(saved, before) and counter.n == 1


def test_a_save_state_that_raises_leaves_its_directory_refused(tmp_path):
    accelerator, model, counter = setup(0)
    accelerator.save_state(str(tmp_path / "good"))
    assert markers(tmp_path / "good") == []  # a finished save leaves no marker
    counter.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        accelerator.save_state(str(tmp_path / "bad"))
    assert markers(tmp_path / "bad") == [f"{sa.INCOMPLETE}0"]

    accelerator2, model2, _ = setup(1)
    before = weights(model2)
    with pytest.raises(snapshard.CheckpointNotFoundError, match="incomplete") as e:
        accelerator2.load_state(str(tmp_path / "bad"))
    assert "save into" in str(e.value) and same(weights(model2), before)
    accelerator2.load_state(str(tmp_path / "good"))
    assert same(weights(model2), weights(model))

    counter.fail = False  # saving into the same directory again makes it whole
    accelerator.save_state(str(tmp_path / "bad"))
    assert markers(tmp_path / "bad") == []
    accelerator2.load_state(str(tmp_path / "bad"))


def test_markers_of_process_indices_the_job_does_not_have_are_removed_by_process_0(tmp_path):
    accelerator, _, _ = setup(0)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / f"{sa.INCOMPLETE}3").write_text("")  # a killed save of 4 processes
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert markers(tmp_path / "ckpt") == []


def test_hooks_registered_by_hand_leave_no_marker(tmp_path):
    accelerator = Accelerator(cpu=True)
    accelerator.register_save_state_pre_hook(sa.save_hook())
    accelerator.register_load_state_pre_hook(sa.load_hook())
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / sa.NAME).is_dir() and markers(tmp_path / "ckpt") == []
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert model.weight.shape == (2, 4)


def test_a_cpu_launch_that_started_one_process_says_what_works(monkeypatch, caplog):
    """`accelerate launch --cpu --num_processes 2` runs one process with these variables."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with caplog.at_level(logging.WARNING, "snapshard"):
        sa.use_snapshard(Accelerator(cpu=True))
    text = caplog.text
    assert "ONE process" in text and "--multi_gpu --num_processes N" in text
    assert "torchrun --nproc-per-node N" in text
    caplog.clear()
    monkeypatch.delenv("MASTER_PORT")  # `accelerate launch --cpu` of one process
    with caplog.at_level(logging.WARNING, "snapshard"):
        sa.use_snapshard(Accelerator(cpu=True))
    assert "ONE process" not in caplog.text
