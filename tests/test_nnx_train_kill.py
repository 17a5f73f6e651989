"""examples/nnx_train.py killed with SIGKILL during a save: the rerun resumes from the newest
committed step and its losses and final parameters are bit-identical to an uninterrupted
run's."""

from __future__ import annotations

import re

import pytest

import multiproc
from snapshard.storage import LocalRoot

for _mod in ("flax", "optax", "grain"):
    pytest.importorskip(_mod)
pytestmark = pytest.mark.slow

STEPS, EVERY = 9, 3  # saves at steps 3, 6, 9


def train(directory, *kill):
    # Kills injected into the save's own code need it in this process's threads.
    env = {"SNAPSHARD_BACKGROUND": "thread"} if kill else None
    args = (directory, STEPS, EVERY, *kill)
    (p,) = multiproc.run("nnx_train_kill.py", 1, 8, *args, timeout=120, check=not kill, env=env)
    losses = [r["loss"] for r in p.results if "loss" in r]
    return p, losses


def final_line(p) -> str:
    (line,) = [s for s in p.stdout.splitlines() if re.match(r"step \d+ loss ", s)]
    return line


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    p, losses = train(tmp_path_factory.mktemp("nnx-ref") / "run")
    assert len(losses) == STEPS and p.result() == {"code": 0}
    return losses, final_line(p)


@pytest.mark.parametrize(
    ("point", "save", "committed"),
    [
        ("write", 2, [3]),  # while step 6's data files are written, training going on
        ("commit", 3, [3, 6]),  # step 9 written, its commit not made
    ],
)
def test_killed_example_resumes_bit_identical(tmp_path, reference, point, save, committed):
    ref_losses, ref_final = reference
    run_dir = tmp_path / "run"
    killed, before = train(run_dir, point, save)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert len(before) >= EVERY * save  # it trained up to the step being saved
    assert before == ref_losses[: len(before)]
    listing = LocalRoot(run_dir).list()
    assert sorted(int(n) for n, ok in listing.items() if ok) == committed
    assert listing.get(str(EVERY * save)) is False  # the step being saved stays invisible

    resumed, after = train(run_dir)
    start = committed[-1]
    assert f"resumed at step {start} on mesh 2x4" in resumed.stdout
    assert after == ref_losses[start:]  # exact floats: the same data, dropout and updates
    assert final_line(resumed) == ref_final  # the final parameters' digest
    assert sorted(LocalRoot(run_dir).list()) == ["6", "9"]  # max_to_keep=2, leftovers gone
