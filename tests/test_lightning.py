"""snapshard.lightning.CheckpointIO: Lightning's whole state as a snapshard checkpoint; a
real Trainer on CPU killed with SIGKILL after a checkpoint resumes bit-exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import multiproc  # noqa: E402
import snapshard.lightning as sl  # noqa: E402
import snapshard.torch as sst  # noqa: E402

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "workers" / "lightning_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


class Opaque:
    def __init__(self, n: int):
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.n == self.n


def checkpoint() -> dict:
    return {
        "state_dict": OrderedDict(w=torch.arange(6.0).reshape(2, 3), b=torch.zeros(2)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [
            {"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]}],
        "epoch": 2,
        "hyper_parameters": {"width": 8, "name": "mlp", "custom": Opaque(5)},
    }  # fmt: skip


def test_round_trip_pickles_only_what_snapshard_cannot_store(tmp_path):
    path = tmp_path / "epoch=2-step=6.ckpt"
    sl.CheckpointIO().save_checkpoint(checkpoint(), path)
    # tensors and plain values are ordinary leaves; only the custom object is opaque bytes
    raw = sst.load(path)
    assert torch.equal(raw["state_dict"]["w"], torch.arange(6.0).reshape(2, 3))
    assert raw["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert raw["hyper_parameters"]["width"] == 8
    assert set(raw["hyper_parameters"]["custom"]) == {sl.PICKLED}
    with pytest.raises(sl.UntrustedPickleError, match=r"/hyper_parameters/custom"):
        sl.CheckpointIO().load_checkpoint(path)
    with pytest.raises(sl.UntrustedPickleError, match="weights_only=True"):
        sl.CheckpointIO(trust_pickle=True).load_checkpoint(path, weights_only=True)
    back = sl.CheckpointIO(trust_pickle=True).load_checkpoint(path, map_location="cpu")
    want = checkpoint()
    assert back["hyper_parameters"] == want["hyper_parameters"]
    assert back["epoch"] == 2
    assert back["optimizer_states"][0]["state"][0]["step"].item() == 3.0
    for k, v in want["state_dict"].items():
        assert torch.equal(back["state_dict"][k], v)


def test_saving_again_replaces_and_remove_deletes(tmp_path):
    io = sl.CheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"epoch": 1, "w": torch.ones(3)}, path)
    io.save_checkpoint({"epoch": 2, "w": torch.full((3,), 2.0)}, path)
    back = io.load_checkpoint(path)
    assert back["epoch"] == 2 and torch.equal(back["w"], torch.full((3,), 2.0))
    io.remove_checkpoint(path)
    assert not path.exists()
    io.remove_checkpoint(path)  # already gone: nothing to do


def test_bad_input_is_refused_clearly(tmp_path):
    io = sl.CheckpointIO()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "a.ckpt", storage_options={"x": 1})
    with pytest.raises(ValueError, match="reserved key"):
        io.save_checkpoint({"x": {sl.PICKLED: 1}}, tmp_path / "b.ckpt")
    with pytest.raises(Exception, match=r"missing\.ckpt"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "c.ckpt")
    with pytest.raises(TypeError, match="map_location"):
        io.load_checkpoint(tmp_path / "c.ckpt", map_location={"cuda:0": "cpu"})


def test_lightning_own_async_wrapper_saves_and_loads_through_it(tmp_path):
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    io = AsyncCheckpointIO(sl.CheckpointIO())
    w = torch.ones(4)
    io.save_checkpoint({"w": w, "epoch": 1}, tmp_path / "a.ckpt")
    w.add_(1)  # the wrapper cloned the tensors when the save was submitted
    io.teardown()
    back = io.load_checkpoint(tmp_path / "a.ckpt")
    assert torch.equal(back["w"], torch.ones(4)) and back["epoch"] == 1


def test_snapshard_async_wrapper_queues_removal_behind_saves(tmp_path):
    io = sl.AsyncCheckpointIO(sl.CheckpointIO())
    for i in range(3):
        io.save_checkpoint({"w": torch.full((1000,), float(i))}, tmp_path / f"{i}.ckpt")
        if i:
            io.remove_checkpoint(tmp_path / f"{i - 1}.ckpt")
    back = io.load_checkpoint(tmp_path / "2.ckpt")  # waits for the queue
    assert torch.equal(back["w"], torch.full((1000,), 2.0))
    io.teardown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2.ckpt"]


def start(mode: str, directory: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(directory), str(out)], env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(p: subprocess.Popen, timeout: float = 120) -> None:
    try:
        output, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        output, _ = p.communicate()
        raise AssertionError(f"worker ran past {timeout} s:\n{output[-4000:]}") from None
    assert p.returncode == 0, output[-4000:]


def test_trainer_killed_after_a_checkpoint_resumes_bit_exactly(tmp_path):
    full = start("full", tmp_path / "full", tmp_path / "full.pt")
    marker = tmp_path / "checkpointed"
    killed = start("kill", tmp_path / "run", marker)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert killed.poll() is None, killed.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
        assert killed.returncode == -signal.SIGKILL
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    committed = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert "last.ckpt" in committed and not any("snapshard-tmp" in n for n in committed)
    resumed = start("resume", tmp_path / "run", tmp_path / "resumed.pt")
    finish(full)
    finish(resumed)
    want = torch.load(tmp_path / "full.pt")
    got = torch.load(tmp_path / "resumed.pt")
    assert want["start"] == (0, 0)
    assert got["start"] == (8, 1)  # resumed after the first epoch's 8 steps, not from scratch
    assert want["weights"].keys() == got["weights"].keys()
    for k, v in want["weights"].items():
        assert torch.equal(v, got["weights"][k]), k
    # ModelCheckpoint's save_top_k=1 removed the worse checkpoints; last.ckpt was replaced
    for run in ("full", "run"):
        names = sorted(p.name for p in (tmp_path / run).iterdir())
        assert len(names) == 2 and names[1] == "last.ckpt" and names[0].startswith("epoch="), names
    last = sl.CheckpointIO().load_checkpoint(tmp_path / "run" / "last.ckpt")
    assert last["epoch"] == 2 and last["global_step"] == 24


def test_ddp_on_two_ranks_saves_through_rank_0_alone_and_resumes(tmp_path):
    """Lightning saves on global rank 0 alone: the plugin's save is one process's, whatever
    the job's process group (it waited for rank 1 and failed)."""

    def torchrun(mode: str, out: Path, epochs: int = 3) -> None:
        args = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(multiproc.free_port()),
            str(WORKER), mode, str(tmp_path / "run"), str(out),
        ]  # fmt: skip
        env = {**ENV, "LIGHTNING_TEST_EPOCHS": str(epochs)}
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    torchrun("full", tmp_path / "full.pt")
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names[-1] == "last.ckpt" and names[0].startswith("epoch="), names
    assert (tmp_path / "run" / "last.ckpt" / "manifest.json").is_file()  # snapshard's
    torchrun("resume", tmp_path / "resumed.pt", epochs=4)  # one epoch more
    steps, epoch = torch.load(tmp_path / "resumed.pt")["start"]
    assert epoch == 3 and steps > 0  # restored at the end of the saved fit, not from scratch
