"""Per-process values (snapshard.PerProcess) and the check that every other host value is
the same on every process, with real processes."""

from __future__ import annotations

import numpy as np
import pytest

import multiproc
import snapshard

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of per-process values saved by 2 processes (the tests only read it)."""
    ckpt = tmp_path_factory.mktemp("per_process") / "ckpt"
    multiproc.run("per_process.py", 2, 2, "save", ckpt, timeout=120)
    return ckpt


def test_each_process_restores_its_own_value_and_resplits_onto_another_count(saved):
    ckpt = saved
    same = multiproc.run("per_process.py", 2, 2, "restore", ckpt, timeout=120)
    assert [p.result()["it"] for p in same] == [3, 7]
    assert [p.result()["tag"] for p in same] == ["host0", "host1"]
    assert all(p.result()["shared"] == [0, 1, 2, 3] for p in same)
    # One process, two saved values: `resplit` decides (here: their sum).
    one = multiproc.run("per_process.py", 1, 2, "restore", ckpt, timeout=120)
    assert one[0].result()["it"] == 10


def test_restoring_per_process_values_on_another_count_without_resplit_names_the_leaf(saved):
    ckpt = saved
    with pytest.raises(snapshard.TargetMismatchError, match=r"leaf 'it' .* saved by 2 processes"):
        snapshard.load(ckpt)
    # Shared leaves still restore alone.
    assert snapshard.load(ckpt, {"shared": np.zeros(4, np.int64)})["shared"].tolist() == [
        0,
        1,
        2,
        3,
    ]


@pytest.mark.parametrize(
    ("mode", "match"),
    [
        ("differ", r"leaf 'shared' has another value on process 1"),
        ("shape", r"leaf 'shared' differs between process 0 and process 1"),
        ("key", r"leaf 'key'"),
        (
            "extra",
            r"process 1 saved 3 leaves, process 0 saved 2 leaves; process 1 has 1 that process 0 "
            r"has not \(after 'shared' in its tree\)",
        ),
        (
            "missing",
            r"process 1 saved 1 leaf, process 0 saved 2 leaves; 'lr' of process 0 not on "
            r"process 1",
        ),
    ],
)
def test_values_that_differ_between_processes_are_refused_naming_the_leaf(tmp_path, mode, match):
    ckpt = tmp_path / "ckpt"
    procs = multiproc.run("per_process.py", 2, 2, mode, ckpt, timeout=120)
    for p in procs:
        r = p.result()
        assert r.get("error") == "CoordinationError", r
        assert __import__("re").search(match, r["message"]), r["message"]
    if mode == "extra":  # the process whose tree has the leaf names it
        message = procs[1].result()["message"]
        assert message.endswith("this process's leaves that process 0 has not: 'extra'"), message
    assert not ckpt.exists()
