"""Kill a training run with SIGKILL during an async save; the restart resumes from the newest
complete step and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import multiproc
from snapshard.storage import LocalRoot

STEPS, EVERY = "12", "3"  # saves at steps 3, 6, 9, 12


def train(directory, *kill):
    # Kills injected into the save's own code need it in this process's threads.
    env = {"SNAPSHARD_BACKGROUND": "thread"} if kill and kill[0] != "writer" else None
    args = (directory, STEPS, EVERY, *kill)
    return multiproc.run("train_kill.py", 1, 8, *args, timeout=120, check=not kill, env=env)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref") / "run").result()["digest"]


@pytest.mark.parametrize("point", ["stage", "write", "commit", "writer"])
def test_killed_during_async_save_resumes_from_newest_complete_step(tmp_path, reference, point):
    """'writer': the training process dies while its writer process saves; the writer
    ends by itself (its socket closed), nothing is committed."""
    run_dir = tmp_path / "run"
    killed = train(run_dir, point, 3)  # the third save: step 9
    assert killed.returncode == -9, killed.stderr[-2000:]
    if point == "writer":
        lines = [x for x in killed.stdout.splitlines() if x.startswith("WRITER ")]
        assert len(lines) == 1, killed.stdout[-2000:] + killed.stderr[-3000:]
        (line,) = lines
        writer = Path(f"/proc/{line.split()[1]}")
        deadline = time.monotonic() + 30
        while writer.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not writer.exists() or "Z" in (writer / "stat").read_text().split()[2]
    listing = LocalRoot(run_dir).list()
    assert sorted(int(n) for n, ok in listing.items() if ok) == [3, 6]
    if point != "stage":
        assert listing.get("9") is False  # the staged files of step 9 are there, uncommitted
    resumed = train(run_dir)
    assert "resumed from step 6" in resumed.stdout
    assert resumed.result()["digest"] == reference
    assert sorted(LocalRoot(run_dir).list()) == ["12", "9"]  # max_to_keep=2, the leftovers cleaned
