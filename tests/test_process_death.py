"""The death of a process during a save: survivors learn it in bounded time, named, and
nothing is committed. Saves leave no coordination keys behind."""

from __future__ import annotations

import signal

import pytest

import multiproc

pytestmark = pytest.mark.timeout(180)


def test_a_process_dying_mid_save_is_named_to_process_0_within_the_timeout(tmp_path):
    ckpt = tmp_path / "ckpt"
    procs = multiproc.run("dies_mid_save.py", 2, 2, ckpt, 1, 5, timeout=90, check=False)
    assert procs[1].returncode == -signal.SIGKILL
    r = procs[0].result()
    assert not r["ok"] and r["error_type"] == "CoordinationError"
    assert "process(es) [1] did not report within 5 s" in r["error"]
    assert r["seconds"] < 15
    assert not ckpt.exists()


def test_when_process_0_dies_the_others_stop_in_bounded_time_and_nothing_is_committed(tmp_path):
    """Process 0 hosts JAX's coordination service. When it dies, a survivor in a snapshard
    wait gets a CoordinationError naming process 0; but JAX's client also polls the service
    for errors and terminates the process (SIGABRT) as soon as that poll fails, which on
    this JAX version usually comes first. Either way it never hangs (docs/design.md)."""
    ckpt = tmp_path / "ckpt"
    procs = multiproc.run("dies_mid_save.py", 2, 2, ckpt, 0, 600, timeout=60, check=False)
    assert procs[0].returncode == -signal.SIGKILL
    survivor = procs[1]
    assert "[killed: the run exceeded" not in survivor.stderr
    if survivor.results:
        r = survivor.result()
        assert r["error_type"] == "CoordinationError" and "process 0" in r["error"]
    else:
        assert survivor.returncode == -signal.SIGABRT
        assert "distributed service detected fatal errors" in survivor.stderr
    assert not ckpt.exists()


def test_saves_delete_their_coordination_keys(tmp_path):
    procs = multiproc.run("dies_mid_save.py", 2, 2, tmp_path / "c", -1, 60, timeout=120)
    for p in procs:
        assert p.result()["ok"] and p.result()["left"] == []
