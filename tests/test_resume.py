"""Kill a training run with SIGKILL during an async save; the restart resumes from the newest
complete step and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import pytest

import multiproc
from snapshard.storage import LocalRoot

STEPS, EVERY = "12", "3"  # saves at steps 3, 6, 9, 12


def train(directory, *kill):
    return multiproc.run(
        "train_kill.py", 1, 8, directory, STEPS, EVERY, *kill, timeout=120, check=not kill
    )[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref") / "run").result()["digest"]


@pytest.mark.parametrize("point", ["stage", "write", "commit"])
def test_killed_during_async_save_resumes_from_newest_complete_step(tmp_path, reference, point):
    run_dir = tmp_path / "run"
    killed = train(run_dir, point, 3)  # the third save: step 9
    assert killed.returncode == -9, killed.stderr[-2000:]
    listing = LocalRoot(run_dir).list()
    assert sorted(int(n) for n, ok in listing.items() if ok) == [3, 6]
    if point != "stage":
        assert listing.get("9") is False  # the staged files of step 9 are there, uncommitted
    resumed = train(run_dir)
    assert "resumed from step 6" in resumed.stdout
    assert resumed.result()["digest"] == reference
    assert sorted(LocalRoot(run_dir).list()) == ["12", "9"]  # max_to_keep=2, the leftovers cleaned
