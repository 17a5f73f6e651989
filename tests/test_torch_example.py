"""examples/fsdp_train.py in real processes (gloo on CPU, launched as torchrun would): killed
with SIGKILL after a committed step, a rerun prints the losses of a run never interrupted,
bit for bit; a 2-D FSDP x TP run resumes onto 2 ranks of 1-D FSDP with the saved state."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

import multiproc

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "fsdp_train.py"


def start(n: int, logs: Path, *args: object) -> list[subprocess.Popen]:
    """n ranks of the example, with the environment torchrun gives them; output to files."""
    port = multiproc.free_port()
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(n):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        with open(logs / f"{rank}.out", "w") as out, open(logs / f"{rank}.err", "w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(EXAMPLE), *map(str, args)],
                    env=env,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                )
            )
    return procs


def wait(procs: list[subprocess.Popen], logs: Path, timeout: float = 150) -> dict[str, dict]:
    """Wait for every rank (all killed at the deadline); rank 0's report lines."""
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(
                    f"the run exceeded {timeout} s:\n{(logs / '0.err').read_text()[-3000:]}"
                )
            assert p.returncode == 0, f"rank {rank}: {(logs / f'{rank}.err').read_text()[-3000:]}"
    finally:
        multiproc.kill_all(procs)
    return report(logs)


def report(logs: Path) -> dict[str, dict]:
    out: dict[str, dict] = {"loss": {}, "saved": {}, "restored": {}}
    for line in (logs / "0.out").read_text().splitlines():
        kind, step, value = line.split()
        out[kind][int(step)] = value
    return out


def committed(directory: Path, step: int) -> bool:
    return (directory / str(step) / "manifest.json").is_file()


def test_killed_run_resumes_with_the_losses_of_an_uninterrupted_one(tmp_path):
    steps = ["--steps", 12, "--save-every", 3, "--mesh", 2]
    whole = wait(start(2, tmp_path / "whole", "--dir", tmp_path / "a", *steps), tmp_path / "whole")
    assert sorted(whole["loss"]) == list(range(1, 13))

    run = tmp_path / "b"
    procs = start(2, tmp_path / "killed", "--dir", run, *steps, "--step-seconds", 0.4)
    try:
        deadline = time.monotonic() + 120
        while not committed(run, 6):
            assert time.monotonic() < deadline, (tmp_path / "killed" / "0.err").read_text()[-3000:]
            assert all(p.poll() is None for p in procs), "the run ended before it was killed"
            time.sleep(0.05)
    finally:
        multiproc.kill_all(procs)  # SIGKILL, every rank
    killed = report(tmp_path / "killed")
    assert max(killed["loss"]) < 12  # it really was cut short

    resumed = wait(start(2, tmp_path / "resumed", "--dir", run, *steps), tmp_path / "resumed")
    first = min(resumed["loss"])
    assert first in (7, 10)  # from the newest committed step (6, or 9 if it committed too)
    assert resumed["loss"] == {s: v for s, v in whole["loss"].items() if s >= first}
    # what the killed run had left half-written is gone; the newest 2 steps are kept
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["12", "9"]


def test_fsdp_x_tp_on_4_ranks_resumes_onto_2_ranks_of_fsdp(tmp_path):
    run = tmp_path / "run"
    four = wait(
        start(4, tmp_path / "four", "--dir", run, "--steps", 6, "--mesh", "2x2", "--digests"),
        tmp_path / "four",
    )
    assert sorted(four["saved"]) == [3, 6]
    two = wait(
        start(2, tmp_path / "two", "--dir", run, "--steps", 9, "--mesh", 2, "--digests"),
        tmp_path / "two",
    )
    # The state restored on the other world size and mesh is the saved one, bit for bit...
    assert two["restored"] == {6: four["saved"][6]}
    # ...and training goes on from it (and saves again).
    assert sorted(two["loss"]) == [7, 8, 9]
    assert all(float.fromhex(v) > 0 for v in two["loss"].values())
    assert sorted(two["saved"]) == [9] and committed(run, 9)
