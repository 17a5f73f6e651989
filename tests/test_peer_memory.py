"""Shared segments between the processes of a job on one host (coordination/peer_memory.py),
with threads as the processes of a job over one in-memory store."""

from __future__ import annotations

import glob
import os
import threading

import numpy as np
import pytest

from snapshard.coordination import SingleProcessCoordinator
from snapshard.coordination import peer_memory as pm
from snapshard.coordination.rendezvous import Rendezvous
from snapshard.errors import CoordinationError

pytestmark = pytest.mark.skipif(not os.path.isdir(pm.SHM_DIR), reason="no /dev/shm here")


@pytest.fixture(autouse=True)
def own_prefix(monkeypatch):
    """Names of this test's own: the checks that no segment is left see only this test's,
    not those of jobs running beside it (other test processes on the host)."""
    monkeypatch.setattr(pm, "PREFIX", f"{pm.PREFIX}test-{os.getpid()}-")


class Rank(SingleProcessCoordinator):
    """One rank's view of a store shared by `n` ranks."""

    def __init__(self, shared: SingleProcessCoordinator, rank: int, n: int) -> None:
        super().__init__()
        self._kv, self._cond = shared._kv, shared._cond
        self.process_index, self.process_count = rank, n


def _ours() -> set[str]:
    return set(glob.glob(os.path.join(pm.SHM_DIR, pm.PREFIX + "*")))


def _job(n, body, timeout_s=10.0, ranks=None, barriers=(), keys=False):
    """body(rank, rendezvous) on n threads; their results (or exceptions), by rank (and
    with `keys`, the keys left in the store); a failure breaks `barriers`."""
    shared = SingleProcessCoordinator()
    out: list = [None] * n

    def run(r):
        rv = Rendezvous(Rank(shared, r, n), "snapshard/test/0", "test exchange", timeout_s)
        try:
            out[r] = body(r, rv)
        except Exception as e:
            out[r] = e
            for b in barriers:
                b.abort()  # the others fail too, rather than wait

    threads = [threading.Thread(target=run, args=(r,)) for r in (ranks or range(n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return (out, shared.keys()) if keys else out


def test_every_rank_reads_every_segment_and_no_name_is_left():
    before = _ours()
    sizes = [4096, 0, 10_000]
    written = threading.Barrier(3, timeout=20)

    def body(r, rv):
        mem = pm.PeerMemory.open(rv, sizes)
        assert mem is not None
        mine = mem.mine()
        assert len(mine) >= sizes[r]
        mine[: sizes[r]] = (np.arange(sizes[r]) * (r + 1)) % 251
        written.wait()
        assert _ours() == before  # every name is gone once open has returned everywhere
        got = {p: mem.of(p)[: sizes[p]].copy() for p in range(3)}
        with pytest.raises(ValueError):
            mem.of((r + 1) % 3)[0] = 1  # the others' segments are read-only
        del mine
        mem.close()
        return got

    out, keys = _job(3, body, barriers=[written], keys=True)
    assert keys == []  # the store keeps nothing of it
    for r in range(3):
        assert not isinstance(out[r], Exception), out[r]
        for p in range(3):
            assert np.array_equal(out[r][p], (np.arange(sizes[p]) * (p + 1)) % 251)
    assert _ours() == before


@pytest.mark.parametrize("where", ["_make", "_map"])
def test_a_rank_that_cannot_share_makes_every_rank_fall_back(monkeypatch, where):
    """Rank 1 cannot make its segment (no room), or cannot map its peers' (another host,
    another /dev/shm): every rank gets None, and no segment is left."""
    before = _ours()
    real = getattr(pm, where)
    me = threading.local()

    def failing(path, nbytes):
        if getattr(me, "rank", None) == 1:
            raise OSError("no room")
        return real(path, nbytes)

    monkeypatch.setattr(pm, where, failing)

    def body(r, rv):
        me.rank = r
        return pm.PeerMemory.open(rv, [1024] * 3)

    assert _job(3, body) == [None, None, None]
    assert _ours() == before


def test_disabled_opens_nothing(monkeypatch):
    monkeypatch.setattr(pm, "ENABLED", False)
    assert _job(2, lambda r, rv: pm.PeerMemory.open(rv, [64, 64])) == [None, None]


def test_a_missing_process_0_is_named_in_bounded_time():
    before = _ours()
    out = _job(2, lambda r, rv: pm.PeerMemory.open(rv, [64, 64]), timeout_s=0.5, ranks=[1])
    assert isinstance(out[1], CoordinationError) and "process 0" in str(out[1])
    assert _ours() == before


def test_kept_segments_serve_the_next_open_of_the_same_ranks():
    """With `keep`, a second open of the same ranks, asking no more, gets the same segments
    (nothing made, what was written still there); one asking more, or after a rank dropped
    its own, gets new ones on every rank; none leaves a name or a store key."""
    before = _ours()
    step = threading.Barrier(2, timeout=20)

    def body(r, rv):
        def opened(k, sizes):
            return pm.PeerMemory.open(rv.sub(str(k)), sizes, keep=True)

        first = opened(0, [8192, 8192])
        first.mine()[:4] = r + 1
        first.close()  # kept: still mapped
        step.wait()
        again = opened(1, [4096, 8192])
        same = again is first and bytes(again.of(1 - r)[:4]) == bytes([2 - r] * 4)
        if r == 1:
            again.release()  # rank 1 drops its own: both make new ones
        step.wait()
        fresh = opened(2, [4096, 4096])
        larger = opened(3, [4096, 1 << 20])
        names, size = (first.name, fresh.name, larger.name), len(larger.of(1))
        larger.release()
        return same, fresh is not first, larger is not fresh, size, names

    out, keys = _job(2, body, barriers=[step], keys=True)
    assert not any(isinstance(o, Exception) for o in out), out
    for same, renewed, grown, size, _ in out:
        assert same and renewed and grown and size >= 1 << 20
    assert out[0][4] == out[1][4] and len(set(out[0][4])) == 3  # made alike, anew each time
    assert keys == [] and _ours() == before
