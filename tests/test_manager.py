"""CheckpointManager: save decisions, retention, lifecycle, errors, preemption, intervals."""

from __future__ import annotations

import contextlib
import math
import os
import signal

import numpy as np
import pytest

import snapshard
from snapshard import CheckpointManager
from snapshard.manager import (
    AnyOf,
    AtSteps,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    LeasePolicy,
    ManagerPolicies,
    PreemptionPolicy,
    Retention,
    StepInfo,
)
from snapshard.storage import local_files
from snapshard.storage.stale_staging import STAGING_SUFFIX


def state(step):
    return {"w": np.full((16, 16), step, np.float32), "step": step}


def run(manager, steps, metrics=None):
    for step in steps:
        manager.save(step, state(step), metrics=metrics(step) if metrics else None)
    manager.wait_until_finished()


def on_disk(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_save_interval_and_explicit_steps(tmp_path):
    every_10_and_at = ManagerPolicies(save=AnyOf((EveryNSteps(10), AtSteps(frozenset({3, 25})))))
    with CheckpointManager(tmp_path, policies=every_10_and_at) as m:
        decided = [s for s in range(31) if m.should_save(s)]
        assert decided == [0, 3, 10, 20, 25, 30]
        saved = [s for s in range(31) if m.save(s, state(s))]
        assert saved == decided
        m.wait_until_finished()
        with pytest.raises(ValueError, match="older than the newest saved step 30"):
            m.save(7, state(7), force=True)  # retention would otherwise delete it at once
        assert m.all_steps() == [0, 3, 10, 20, 25, 30]
        assert not m.should_save(10)  # already saved


def test_latest_n_over_30_saves(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=3) as m:
        run(m, range(1, 31))
        assert m.all_steps() == [28, 29, 30]
    assert on_disk(tmp_path) == [28, 29, 30]


def test_keep_period_with_latest_n_over_30_saves(tmp_path):
    keep = ManagerPolicies(retention=(KeepLatest(2), KeepEvery(10)))
    with CheckpointManager(tmp_path, policies=keep) as m:
        run(m, range(1, 31))
        assert m.all_steps() == [10, 20, 29, 30]
    assert on_disk(tmp_path) == [10, 20, 29, 30]


def test_best_n_by_metric_over_30_saves_keeps_unmeasured_steps(tmp_path):
    # Loss is lowest at steps 7, 14, 21 (and 28 has no metrics at all).
    def metrics(step):
        if step == 28:
            return None
        return {"loss": 0.1 * (step % 7) + (1.0 if step > 21 else 0.0) + 0.001 * step}

    best = ManagerPolicies(retention=(KeepBest(3, lambda m: m["loss"], "min"),))
    with CheckpointManager(tmp_path, policies=best) as m:
        run(m, range(1, 31), metrics)
        assert m.all_steps() == [7, 14, 21, 28, 30]  # 3 best, the unmeasured one, the newest
        assert m.best_step() == 7
        assert m.metrics(14)["loss"] == pytest.approx(0.014)
    # A new manager reads the metrics back from the checkpoints.
    with CheckpointManager(tmp_path, policies=best) as m:
        assert m.best_step() == 7 and m.all_steps() == [7, 14, 21, 28, 30]


def test_a_policy_and_its_shorthand_keyword_are_not_both_given(tmp_path):
    with pytest.raises(ValueError, match="save_interval_steps or ManagerPolicies"):
        CheckpointManager(
            tmp_path, save_interval_steps=5, policies=ManagerPolicies(save=EveryNSteps(2))
        )
    with pytest.raises(ValueError, match="max_to_keep or ManagerPolicies"):
        CheckpointManager(tmp_path, max_to_keep=2, policies=ManagerPolicies(retention=(KeepAll(),)))
    with pytest.raises(TypeError, match="policies"):
        CheckpointManager(tmp_path, policies={"save": EveryNSteps(2)})
    CheckpointManager(tmp_path).close()  # refused before the lease was taken: none is held


def test_retention_given_as_a_list_or_one_policy():
    assert ManagerPolicies(retention=[KeepLatest(2)]).retention == (KeepLatest(2),)  # type: ignore[arg-type]
    assert ManagerPolicies(retention=KeepLatest(2)).retention == (KeepLatest(2),)  # type: ignore[arg-type]
    assert ManagerPolicies(retention=(KeepLatest(2), KeepBest(3, len))).best() == KeepBest(1, len)


def test_lease_policy_takes_over_a_held_lease(tmp_path):
    eager = ManagerPolicies(lease=LeasePolicy(at_start=True))  # the lease when made
    first = CheckpointManager(tmp_path, policies=eager)
    try:
        with pytest.raises(snapshard.WriterLeaseError):
            CheckpointManager(tmp_path, policies=eager)
        with CheckpointManager(
            tmp_path, policies=ManagerPolicies(lease=LeasePolicy(takeover=True))
        ) as m:
            m.save(1, state(1))
        assert on_disk(tmp_path) == [1]
    finally:
        with contextlib.suppress(snapshard.WriterLeaseError):
            first.close()


def test_retention_policies_compose():
    steps = [StepInfo(s, {"acc": s % 5}) for s in range(1, 13)]
    r = Retention((KeepLatest(2), KeepEvery(5), KeepBest(2, lambda m: m["acc"])))
    kept = {s.step for s in steps} - set(r.to_delete(steps))
    # latest: 11, 12; every 5: 5, 10; best acc (4): 9 and 4 (newer first on ties)
    assert kept == {4, 5, 9, 10, 11, 12}
    assert Retention((KeepLatest(0),)).to_delete(steps[:3]) == [1, 2]  # never the newest


def test_incomplete_steps_are_never_listed_and_are_cleaned_at_start(tmp_path):
    with CheckpointManager(tmp_path) as m:
        run(m, [1, 2])
    (tmp_path / ("3" + STAGING_SUFFIX) / "data").mkdir(parents=True)
    (tmp_path / ("3" + STAGING_SUFFIX) / "data" / "p00000-x-0.bin").write_bytes(b"partial")
    (tmp_path / "4").mkdir()  # a directory without a manifest is not a step either
    eager = ManagerPolicies(lease=LeasePolicy(at_start=True))  # cleans when made
    with CheckpointManager(tmp_path, policies=eager) as m:
        assert m.all_steps() == [1, 2] and m.latest_step() == 2
        # (the writer lease is there while the manager runs)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name[0] != ".") == ["1", "2"]
        assert m.restore()["step"] == 2


def test_a_committed_step_is_never_overwritten(tmp_path):
    with CheckpointManager(tmp_path) as m:
        run(m, [5])
        with pytest.raises(snapshard.CheckpointExistsError, match="step 5 already exists"):
            m.save(5, state(99), force=True)
        assert m.restore(5)["w"][0, 0] == 5


def fail_step(monkeypatch, step):
    # (injected into this process: the background phase runs in its threads)
    monkeypatch.setenv("SNAPSHARD_BACKGROUND", "thread")
    real = local_files.LocalFileWriter.write

    def write(self, data):
        if self.path.parent.parent.name.startswith(f"{step}{STAGING_SUFFIX}"):
            raise PermissionError(13, f"Permission denied: {self.path} (injected)")
        real(self, data)

    monkeypatch.setattr(local_files.LocalFileWriter, "write", write)


def test_background_error_is_raised_by_the_next_save_naming_the_step(tmp_path, monkeypatch, caplog):
    fail_step(monkeypatch, 2)
    m = CheckpointManager(tmp_path)
    m.save(1, state(1))
    m.save(2, state(2))  # fails in the background
    with pytest.raises(
        snapshard.BackgroundSaveError, match=r"step 2 failed.*Permission denied"
    ) as e:
        m.save(3, state(3))
    assert e.value.step == 2
    assert "background save" in caplog.text  # logged when it happened
    m.save(3, state(3))  # the error was delivered; the manager carries on
    m.close()
    assert m.all_steps() == [1, 3]


def test_background_error_is_raised_by_close(tmp_path, monkeypatch):
    fail_step(monkeypatch, 1)
    m = CheckpointManager(tmp_path)
    m.save(1, state(1))
    with pytest.raises(snapshard.BackgroundSaveError, match="step 1"):
        m.close()
    assert m.all_steps() == []
    assert not (tmp_path / "1").exists()


def test_background_error_is_raised_by_wait_until_finished(tmp_path, monkeypatch):
    fail_step(monkeypatch, 1)
    with CheckpointManager(tmp_path) as m:
        m.save(1, state(1))
        with pytest.raises(snapshard.BackgroundSaveError, match="step 1"):
            m.wait_until_finished()


def test_sigterm_triggers_a_forced_save(tmp_path):
    sigterm = ManagerPolicies(preemption=PreemptionPolicy(handle_sigterm=True))
    with CheckpointManager(tmp_path, save_interval_steps=100, policies=sigterm) as m:
        assert not m.reached_preemption(7)
        os.kill(os.getpid(), signal.SIGTERM)
        assert m.reached_preemption(7)
        assert not m.should_save(7)
        assert m.save(7, state(7), force=True)
        m.wait_until_finished()
        assert m.all_steps() == [7]
    assert signal.getsignal(signal.SIGTERM) is not None


def test_save_durations_are_recorded_and_give_a_young_daly_interval(tmp_path):
    with CheckpointManager(tmp_path) as m:
        run(m, [1, 2, 3])
        t = m.save_timings()
        assert sorted(t) == [1, 2, 3]
        assert all(0 < x.blocking_s <= x.total_s for x in t.values())
        c = sum(x.blocking_s for x in t.values()) / 3
        assert m.recommended_save_interval(3600.0) == pytest.approx(math.sqrt(2 * c * 3600.0))
        assert m.recommended_save_interval(3600.0, step_time_s=1e-3) == max(
            1.0, round(math.sqrt(2 * c * 3600.0) / 1e-3)
        )


def test_restore_waits_for_the_save_in_flight(tmp_path):
    with CheckpointManager(tmp_path) as m:
        m.save(1, state(1))
        out = m.restore(1, {"w": np.zeros((16, 16), np.float32)})
        assert out["w"][0, 0] == 1
        with pytest.raises(snapshard.CheckpointNotFoundError):
            m.restore(9)


def test_a_new_manager_runs_the_staging_check_before_its_first_save(tmp_path, monkeypatch):
    """The check that CPU arrays can be staged without a copy costs a fresh process about
    0.2 s (its first jit); a manager starts it in the background when it is made, so that
    its first save's blocking phase does not wait for it."""
    import time

    from snapshard.jax import arrays as jax_arrays

    monkeypatch.setattr(jax_arrays, "_cpu_donation_safe", None)
    with CheckpointManager(tmp_path / "run"):
        deadline = time.monotonic() + 60
        while jax_arrays._cpu_donation_safe is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert jax_arrays._cpu_donation_safe is not None  # no save has run


def test_a_process_that_exits_right_after_making_a_manager_exits_cleanly(tmp_path):
    """The staging check the manager starts must not be cut off inside XLA at exit (that
    aborts the process in C++)."""
    import subprocess
    import sys

    code = "import snapshard, sys\nsnapshard.CheckpointManager(sys.argv[1]).close()\n"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    for i in range(2):
        p = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / f"run{i}")],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]


def test_orbax_args_are_refused_saying_what_to_pass(tmp_path):
    """An Orbax user's habit (`args=ocp.args.StandardSave(...)`, `Composite`) meets a
    TypeError that says what snapshard's manager takes, before anything is written."""
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {"w": np.ones(3, np.float32)}
    with CheckpointManager(tmp_path, async_save=False) as m:
        m.save(2, state)
        for call in (
            lambda: m.save(4, ocp.args.Composite(state=ocp.args.StandardSave(state))),
            lambda: m.save(4, ocp.args.StandardSave(state)),
            lambda: m.restore(2, ocp.args.StandardRestore(state)),
            lambda: m.restore(2, args=ocp.args.Composite(state=ocp.args.StandardRestore(state))),
        ):
            with pytest.raises(TypeError, match=r"Orbax's \w+: snapshard's manager takes the tree"):
                call()
        assert m.all_steps() == [2]
        assert np.array_equal(m.restore(2, state)["w"], state["w"])
