"""The rendezvous of every save, with ranks as threads over one shared store: which error
each process raises does not depend on who reads the outcome first; process 0 wakes on the
last report, and neither a missing count nor a stray signal makes it wait out the timeout
or spin on the store."""

from __future__ import annotations

import threading
import time

import pytest

from snapshard.coordination.base import SingleProcessCoordinator
from snapshard.coordination.rendezvous import Rendezvous, write_then_commit
from snapshard.errors import CoordinationError, StorageError

OUTCOME = "snapshard/test/0/outcome"


class Rank(SingleProcessCoordinator):
    """One rank's view of a store shared by `n` ranks; `after_set(key)` runs after each set."""

    def __init__(self, shared: SingleProcessCoordinator, rank: int, n: int, after_set=None):
        super().__init__()
        self._kv, self._cond = shared._kv, shared._cond
        self.process_index, self.process_count = rank, n
        self._after_set = after_set

    def set(self, key: str, value: str) -> None:
        super().set(key, value)
        if self._after_set is not None:
            self._after_set(key)


def _wait_for(shared: SingleProcessCoordinator, key: str) -> None:
    shared.get(key, 10.0)


def _run(writes, after_set=None) -> list:
    """write_then_commit on len(writes) threads; each rank's result or exception."""
    shared = SingleProcessCoordinator()
    n = len(writes)
    out: list = [None] * n
    discarded: list = [None] * n

    def run(r):
        coord = Rank(shared, r, n, after_set(shared, r) if after_set else None)
        rv = Rendezvous(coord, "snapshard/test/0", "save to /ckpt", 10.0)
        rv.start_clock()
        try:
            out[r] = write_then_commit(
                rv, lambda: writes[r](shared), lambda docs: None,
                discard=lambda: None,
                discard_own=lambda settled: discarded.__setitem__(r, settled),
            )  # fmt: skip
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return [*out, discarded]


def _ok(shared):
    return {"files": 1}


def _fails(shared):
    raise StorageError("write (at byte 0) of /ckpt.snapshard-tmp/data/1: injected fault")


def test_the_failing_process_raises_its_own_error_even_when_the_relay_came_first():
    # Process 1 reports its failure; process 0 relays it as the outcome before process 1
    # looks at the outcome (the order a loaded machine gives at random): process 1 still
    # raises its own error, process 0 names process 1.
    def after_set(shared, rank):
        def hook(key):
            if rank == 1 and key.endswith("/written/1"):
                _wait_for(shared, OUTCOME)

        return hook

    leader, failed, discarded = _run([_ok, _fails], after_set)
    assert isinstance(failed, StorageError) and not isinstance(failed, CoordinationError)
    assert str(failed).startswith("write (at byte 0) of /ckpt.snapshard-tmp")
    assert isinstance(leader, CoordinationError)
    assert str(leader).startswith(
        "save to /ckpt: process 1 failed: StorageError: write (at byte 0)"
    )
    assert discarded[1] is False  # process 0 had not failed the save before process 1


def test_a_process_failing_after_process_0_failed_the_save_raises_process_0s_error():
    # Process 0 fails first and removes the staging area; process 1's write then fails
    # because of it: process 1 raises process 0's error, the cause, not its consequence.
    def leader_fails(shared):
        raise StorageError("creation of /ckpt.snapshard-tmp failed: injected fault")

    def fails_after_the_outcome(shared):
        _wait_for(shared, OUTCOME)
        time.sleep(0.01)
        raise StorageError("write (at byte 0) of /ckpt.snapshard-tmp/data/1: no such file")

    leader, failed, discarded = _run([leader_fails, fails_after_the_outcome])
    assert str(leader).startswith("creation of /ckpt.snapshard-tmp failed")
    assert isinstance(failed, CoordinationError) and isinstance(failed, StorageError)
    assert str(failed).startswith(
        "save to /ckpt failed: StorageError: creation of /ckpt.snapshard-tmp"
    )
    assert isinstance(failed.__cause__, StorageError)
    assert discarded[1] is True


def _counting(shared, rank, n, calls):
    coord = Rank(shared, rank, n)
    real = coord.get_dir

    def get_dir(prefix):
        calls.append(prefix)
        return real(prefix)

    coord.get_dir = get_dir  # type: ignore[method-assign]
    return coord


def test_process_0_wakes_on_the_last_report_instead_of_polling_and_no_key_is_left():
    # Three ranks, the last one 0.3 s late: process 0 lists the reports when it starts to
    # wait and once more when the last report's signal comes, not at a doubling pause.
    shared = SingleProcessCoordinator()
    lists: list = []
    out: list = [None] * 3

    def run(r):
        coord = _counting(shared, r, 3, lists) if r == 0 else Rank(shared, r, 3)
        rv = Rendezvous(coord, "snapshard/test/0", "save to /ckpt", 10.0)
        rv.start_clock()

        def write():
            time.sleep(0.3 if r == 2 else 0.0)
            return {"rank": r}

        out[r] = write_then_commit(rv, write, lambda docs: None, lambda: None, lambda s: None)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
    assert 1 <= len(lists) <= 3, lists
    assert shared.keys() == []  # the reports, their count and signal, the outcome: all gone


def test_a_process_that_reported_without_its_count_is_gathered_at_the_next_listing(
    monkeypatch,
):
    # A process (its writer) that died between its report and its count leaves the signal
    # unset: process 0 finds the report at its next listing, not at the timeout.
    from snapshard.coordination import rendezvous

    monkeypatch.setattr(rendezvous, "_RELIST_S", 0.05)
    shared = SingleProcessCoordinator()
    other = Rendezvous(Rank(shared, 1, 2), "snapshard/test/0", "save to /ckpt", 10.0)
    leader = Rendezvous(Rank(shared, 0, 2), "snapshard/test/0", "save to /ckpt", 10.0)
    leader.start_clock()
    threading.Timer(0.2, lambda: other.report("written/1", files=3)).start()
    t0 = time.monotonic()
    assert leader.gather("written") == {1: {"ok": True, "error": None, "error_type": None,
                                            "relay": None, "files": 3}}  # fmt: skip
    assert time.monotonic() - t0 < 5.0


def test_a_signal_without_every_report_does_not_make_process_0_spin(monkeypatch):
    # The protocol never sets the signal before every report is in (or one failed); were it
    # found so, process 0 lists the reports a relist apart until the timeout, naming the
    # process missing, instead of listing in a tight loop.
    from snapshard.coordination import rendezvous

    monkeypatch.setattr(rendezvous, "_RELIST_S", 0.05)
    shared = SingleProcessCoordinator()
    lists: list = []
    leader = Rendezvous(_counting(shared, 0, 2, lists), "snapshard/test/0", "save to /ckpt", 0.5)
    shared.set("snapshard/test/0/written/complete", "1")
    leader.start_clock()
    with pytest.raises(CoordinationError, match=r"process\(es\) \[1\] did not report"):
        leader.gather("written")
    assert 2 <= len(lists) <= 15, len(lists)
