"""A fault at every storage operation of a save, an overwrite, a manager save with retention
and a restore, on local disk and on the S3 server (see faultinject.py).

A fault-free run records every call the scenario makes below the storage layer; then each
(operation, index) fails once, in a fresh location. For every one of them:

- the call raises a snapshard error whose message carries the failure and names the
  location (never a raw OSError, never a hang), or (a best-effort step failing, or a
  failure after the commit point) finishes;
- every checkpoint listed as committed afterwards loads bit-exactly: the steps committed
  before, and the new one only if it is complete; a step retention was to delete is gone
  only if the new one committed;
- the same save, retried, succeeds; a restore returns nothing or the exact values.
"""

from __future__ import annotations

import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import snapshard
from faultinject import INJECTED, FaultInjector
from snapshard.errors import SnapshardError
from snapshard.storage import root_for

from conftest import mesh, run_bounded, sharded

pytestmark = pytest.mark.timeout(240)

STEP_TIMEOUT_S = 30.0


def tree(seed: int) -> dict[str, Any]:
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) * seed
    return {"w": sharded(w, mesh(2, 2), "data", "model"), "b": np.arange(6.0) + seed, "n": seed}


def assert_is(out: Any, seed: int) -> None:
    want = tree(seed)
    assert out["n"] == want["n"]
    for k in ("w", "b"):
        got, exp = np.asarray(out[k]), np.asarray(want[k])
        assert got.dtype == exp.dtype and np.array_equal(got, exp), k


def bounded(fn: Callable[[], Any]) -> BaseException | None:
    """Run fn in a thread; the exception it raised (None if none). Fails on a hang."""
    return run_bounded(fn, STEP_TIMEOUT_S)[1]


def committed(base: str) -> set[str]:
    return {name for name, done in root_for(base).list().items() if done}


# ---- scenarios: set-up (not injected), the run under faults, the checks afterwards ----------
class Save:
    """A new checkpoint beside an older one."""

    def setup(self, base: str) -> None:
        snapshard.save(f"{base}/older", tree(1))

    def run(self, base: str) -> None:
        snapshard.save(f"{base}/ckpt", tree(2))

    def check(self, base: str) -> str:
        names = committed(base)
        assert "older" in names and names <= {"older", "ckpt"}
        assert_is(snapshard.load(f"{base}/older"), 1)
        if "ckpt" in names:
            assert_is(snapshard.load(f"{base}/ckpt"), 2)
            return "committed"
        self.run(base)  # the retry
        assert_is(snapshard.load(f"{base}/ckpt"), 2)
        return "not committed"


class Overwrite:
    """A checkpoint replaced by another: the old one whole or the new one whole."""

    def setup(self, base: str) -> None:
        snapshard.save(f"{base}/ckpt", tree(1))

    def run(self, base: str) -> None:
        snapshard.save(f"{base}/ckpt", tree(2), overwrite=True)

    def check(self, base: str) -> str:
        assert committed(base) == {"ckpt"}
        out = snapshard.load(f"{base}/ckpt")
        outcome = "new" if out["n"] == 2 else "old"
        assert_is(out, 2 if outcome == "new" else 1)
        self.run(base)
        assert_is(snapshard.load(f"{base}/ckpt"), 2)
        return outcome


class ManagerSave:
    """Step 3 of a manager keeping 2: its lease, clean-up, save, commit and retention."""

    def setup(self, base: str) -> None:
        with snapshard.CheckpointManager(base, max_to_keep=2) as m:
            m.save(1, tree(1))
            m.save(2, tree(2))
        assert committed(base) == {"1", "2"}

    def run(self, base: str) -> None:
        with snapshard.CheckpointManager(base, max_to_keep=2) as m:
            m.save(3, tree(3))
            m.wait_until_finished()

    def check(self, base: str) -> str:
        names = committed(base)
        assert "2" in names and names <= {"1", "2", "3"}
        assert "1" in names or "3" in names, "step 1 was deleted before step 3 committed"
        for s in names:
            assert_is(snapshard.load(f"{base}/{s}"), int(s))
        outcome = "committed" if "3" in names else "not committed"
        with snapshard.CheckpointManager(base, max_to_keep=2) as m:  # the retry
            if 3 not in m.all_steps():
                m.save(3, tree(3))
            m.wait_until_finished()
            assert m.all_steps()[-2:] == [2, 3]
        assert_is(snapshard.load(f"{base}/3"), 3)
        return outcome


class Restore:
    """A restore onto a sharded target: a clean error or the exact values."""

    def setup(self, base: str) -> None:
        snapshard.save(f"{base}/ckpt", tree(4))

    def run(self, base: str) -> None:
        self.out = None
        self.out = snapshard.load(f"{base}/ckpt", tree(0))

    def check(self, base: str) -> str:
        if self.out is not None:
            assert_is(self.out, 4)
            return "exact values"
        assert_is(snapshard.load(f"{base}/ckpt", tree(0)), 4)
        return "nothing returned"


SCENARIOS = {"save": Save, "overwrite": Overwrite, "manager": ManagerSave, "restore": Restore}


def walk(
    scenario: Any,
    new_base: Callable[[], str],
    injector: FaultInjector,
    copy: Callable[[str, str], None] | None = None,
) -> tuple[Counter[str], list[str]]:
    """Every fault of the scenario: the outcomes counted, and the faults that gave no error.
    With `copy`, the set-up is made once and copied for each fault (a local directory)."""
    template = new_base()
    scenario.setup(template)

    def setup(base: str) -> None:
        if copy is None:
            scenario.setup(base)
        else:
            copy(template, base)

    base = new_base()
    setup(base)
    injector.reset()
    assert bounded(lambda: scenario.run(base)) is None
    points = injector.points()
    assert points, "the fault-free run made no storage call"
    scenario.check(base)
    tally: Counter[str] = Counter()
    failures: list[str] = []
    silent: list[str] = []
    for op, k in points:
        base = new_base()
        setup(base)
        try:
            outcome = one_fault(scenario, base, injector, op, k)
        except Exception as e:
            failures.append(f"fault at {op} #{k}: {type(e).__name__}: {e}")
            continue
        tally[outcome] += 1
        if outcome.startswith("no error"):
            silent.append(str(injector.fired).replace(base, "<root>"))
    assert not failures, f"{len(failures)} of {len(points)} faults:\n" + "\n".join(failures)
    tally["points"] = len(points)
    return tally, silent


def one_fault(scenario: Any, base: str, injector: FaultInjector, op: str, k: int) -> str:
    """Fail call k of op during the scenario; check what it raised and left. The outcome."""
    injector.arm(op, k)
    error = bounded(lambda: scenario.run(base))
    fired, injector.armed = injector.fired, None
    if error is None:
        return f"no error, {scenario.check(base)}"
    assert isinstance(error, SnapshardError), f"{fired}: {type(error).__name__}: {error}"
    assert fired is not None, f"failed without the fault: {error}"
    msg = str(error)
    assert INJECTED in msg and base in msg, f"{fired}: the error does not say: {msg}"
    return f"{type(error).__name__}, {scenario.check(base)}"


@pytest.fixture
def injector(monkeypatch, tmp_path):
    return FaultInjector(tmp_path).install(monkeypatch)


def report(name: str, tally: Counter[str], silent: list[str]) -> None:
    print(f"\n{name}: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.items())))
    for fault in silent:
        print(f"  no error at {fault}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_fault_on_local_disk(scenario, tmp_path, injector):
    count = iter(range(10**6))
    tally, silent = walk(
        SCENARIOS[scenario](),
        lambda: str(tmp_path / f"p{next(count)}"),
        injector,
        copy=lambda a, b: shutil.copytree(a, b, symlinks=True),
    )
    report(f"local {scenario}", tally, silent)


@pytest.mark.s3
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_fault_on_the_object_store(scenario, s3_bucket, injector):
    tally, silent = walk(
        SCENARIOS[scenario](), lambda: f"s3://{s3_bucket}/{uuid.uuid4().hex[:12]}", injector
    )
    report(f"s3 {scenario}", tally, silent)
