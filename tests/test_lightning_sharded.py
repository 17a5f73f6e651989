"""snapshard.lightning's strategies: Lightning's sharded checkpoints (FSDP2 through
ModelParallelStrategy, FSDP1's ShardedTensors) as snapshard checkpoints written through DCP;
a real 2-process Trainer on CPU killed with SIGKILL resumes bit-exactly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import multiproc  # noqa: E402
import snapshard.lightning as sl  # noqa: E402
import snapshard.torch as sst  # noqa: E402
from snapshard.cli import main as cli  # noqa: E402

ROOT = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "workers" / "lightning_sharded.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def start(mode: str, directory: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(directory), str(out)],
        env={**ENV, "MASTER_PORT": str(multiproc.free_port())}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(p: subprocess.Popen, timeout: float = 240) -> None:
    try:
        output, _ = p.communicate(timeout=timeout)
    finally:
        kill_group(p)
    assert p.returncode == 0, output[-4000:]


def kill_group(p: subprocess.Popen) -> None:
    """Lightning's launcher started the second rank as a child: end both."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)


def plain_model() -> torch.nn.Module:
    """The worker's network, unsharded, under the LightningModule's names."""
    module = torch.nn.Module()
    module.net = torch.nn.Sequential(
        torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )
    return module


def test_trainer_killed_mid_fit_resumes_bit_exactly_and_loads_on_one_process(tmp_path):
    full = start("full", tmp_path / "full", tmp_path / "full.pt")
    marker = tmp_path / "checkpointed"
    killed = start("kill", tmp_path / "run", marker)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert killed.poll() is None, killed.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.05)
    finally:
        kill_group(killed)
    committed = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert "last.ckpt" in committed and not any("snapshard-tmp" in n for n in committed)
    resumed = start("resume", tmp_path / "run", tmp_path / "resumed.pt")
    finish(full)
    finish(resumed)
    want = torch.load(tmp_path / "full.pt")
    got = torch.load(tmp_path / "resumed.pt")
    assert want["start"] == (0, 0)
    assert got["start"][1] >= 1  # resumed after a committed epoch, not from scratch
    assert want["weights"].keys() == got["weights"].keys()
    for k, v in want["weights"].items():
        assert torch.equal(v, got["weights"][k]), k

    last = tmp_path / "full" / "last.ckpt"
    assert cli(["verify", str(last)]) == 0
    # the 2-rank sharded checkpoint restores into one unsharded model, in this process
    model = plain_model()
    rest = sl.load_sharded(str(last), model, [])
    assert rest["epoch"] == 2 and rest["global_step"] == 12
    assert rest["hyper_parameters"] == {"width": 16}
    for k, v in model.state_dict().items():
        assert torch.equal(v, want["weights"][k]), k
    # snapshard's own loader reads it without DCP; Lightning's rest stays opaque bytes
    whole = sst.load(str(last))
    assert torch.equal(whole[sl.MODEL]["net.0.weight"], want["weights"]["net.0.weight"])
    assert whole[sl.OTHER].dtype == torch.uint8


def test_fsdp1_sharded_tensors_round_trip_on_two_ranks(tmp_path):
    (proc, *_) = multiproc.run("lightning_fsdp1.py", 2, 1, tmp_path / "ckpt", timeout=180)
    result = proc.result()
    assert result["kinds"] == ["ShardedTensor"]
    assert result["weights"] and result["optimizer"]
    assert result["rest"] == {
        "epoch": 3, "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": 7}}},
    }  # fmt: skip
    assert cli(["verify", str(tmp_path / "ckpt")]) == 0


class Opaque:
    def __init__(self, n: int):
        self.n = n


def test_objects_beyond_weights_only_need_trust_pickle(tmp_path):
    model = plain_model()
    path = str(tmp_path / "ckpt")
    checkpoint = {"state_dict": model.state_dict(), "epoch": 1, "custom": Opaque(5)}
    sl.save_sharded(path, checkpoint, rank=0)
    with pytest.raises(sl.UntrustedPickleError, match=r"ckpt: Lightning's entries .*trust_pickle"):
        sl.load_sharded(path, plain_model(), [])
    rest = sl.load_sharded(path, plain_model(), [], trust_pickle=True)
    assert rest["epoch"] == 1 and rest["custom"].n == 5
    with pytest.raises(sl.UntrustedPickleError):
        sl.load_sharded(path, plain_model(), [], trust_pickle=True, weights_only=True)


def test_not_a_lightning_checkpoint_is_refused_naming_it(tmp_path):
    sst.save(str(tmp_path / "other"), {"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="other: not a Lightning sharded checkpoint"):
        sl.load_sharded(str(tmp_path / "other"), plain_model(), [])
