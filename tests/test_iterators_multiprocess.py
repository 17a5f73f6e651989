"""Grain iterators as leaves in a real 2-process job: each process saves its own position and
gets it back; another process count is refused naming the leaf, or re-split by `resplit`."""

from __future__ import annotations

import pytest

import multiproc

pytest.importorskip("grain")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory with step 5 saved by 2 processes, and what each process's iterators
    yield next when never interrupted."""
    run_dir = tmp_path_factory.mktemp("iterators") / "run"
    procs = multiproc.run("iterators.py", 2, 2, "save", run_dir, timeout=150)
    return run_dir, [p.result() for p in procs]


def test_each_process_gets_its_own_iterator_positions_back(saved):
    run_dir, expected = saved
    # The processes were at different positions of different shards.
    assert expected[0]["loader"] != expected[1]["loader"]
    assert expected[0]["stream"] == [2, 4, 6]  # process 0: records 0, 2, 4, ...; 1 read
    assert expected[1]["stream"] == [11, 13, 15]  # process 1: records 1, 3, 5, ...; 5 read
    restored = multiproc.run("iterators.py", 2, 2, "restore", run_dir, timeout=150)
    for p in restored:
        r = p.result()
        assert r["same_objects"], "the target's iterators are the ones restored into"
        assert r["loader"] == expected[p.process_id]["loader"], p.process_id
        assert r["stream"] == expected[p.process_id]["stream"], p.process_id
        assert r["w_ok"] and r["step"] == 5


def test_another_process_count_is_refused_naming_the_leaf(saved):
    run_dir, _ = saved
    (one,) = multiproc.run("iterators.py", 1, 4, "count", run_dir, timeout=150)
    r = one.result()
    assert r["error"] == "TargetMismatchError", r
    assert "leaf 'loader' holds one value per process, saved by 2 processes" in r["message"]
    assert "resplit" in r["message"]


def test_resplit_moves_iterators_onto_another_process_count(saved):
    run_dir, _ = saved
    (one,) = multiproc.run("iterators.py", 1, 4, "resplit", run_dir, 2, timeout=150)
    r = one.result()
    # Records 0 and 1 were read (by process 0 and 1); one process resumes at record 2.
    assert r["stream"] == [2, 3, 4]
    assert r["w"] == list(range(16))
    # A DataLoader's position belongs to its sampler's shard: Grain refuses another's.
    assert r["error"] == "TargetMismatchError", r
    assert "leaf 'loader'" in r["message"] and "refused the saved position" in r["message"]
