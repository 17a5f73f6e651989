"""Agreement on the preemption step (coordination/preemption.py), and the manager's use of it.

The ranks of a job are simulated in one process: coordinators that share one key-value store
(a dict, or a c10d HashStore behind TorchStoreCoordinator), called in turn step by step.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import numpy as np
import pytest

from snapshard import CheckpointManager
from snapshard.coordination import SingleProcessCoordinator
from snapshard.coordination.preemption import PreemptionAgreement
from snapshard.errors import CoordinationError
from snapshard.jax.manager import JAX

KEY = "snapshard/preemption/test/0"


class Rank(SingleProcessCoordinator):
    """One rank's view of a store shared by `n` ranks; counts its store operations."""

    def __init__(self, shared: SingleProcessCoordinator, rank: int, n: int) -> None:
        super().__init__()
        self._kv, self._cond = shared._kv, shared._cond
        self.process_index, self.process_count = rank, n
        self.lookups = 0

    def try_get(self, key: str) -> str | None:
        self.lookups += 1
        return super().try_get(key)

    def set_if_absent(self, key: str, value: str) -> str:
        self.lookups += 1
        return super().set_if_absent(key, value)


def dict_ranks(n: int) -> list:
    shared = SingleProcessCoordinator()
    return [Rank(shared, r, n) for r in range(n)]


def store_ranks(n: int) -> list:
    dist = pytest.importorskip("torch.distributed")
    from snapshard.torch import TorchStoreCoordinator

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    return [TorchStoreCoordinator(store, rank=r, world_size=n) for r in range(n)]


@pytest.fixture(params=["dict", "c10d"])
def ranks(request):
    make = dict_ranks if request.param == "dict" else store_ranks
    return lambda n: [PreemptionAgreement(c, KEY) for c in make(n)]


def lockstep(agreements, signalled_at: dict[int, int], order, steps=range(1, 20)) -> dict:
    """Every rank calls `reached` at each step, in `order` (the ranks' interleaving within
    a step); rank r is signalled from step signalled_at[r] on. Returns each rank's first
    true step (and checks that it stays true after)."""
    first: dict[int, int] = {}
    for step in steps:
        for r in order:
            signalled = step >= signalled_at.get(r, 10**9)
            if agreements[r].reached(step, signalled):
                first.setdefault(r, step)
            else:
                assert r not in first, (r, step)
        if len(first) == len(agreements):
            break
    return first


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 0, 2)])
def test_the_proposer_at_s_and_every_other_rank_answer_true_at_s_plus_1(ranks, order):
    a = ranks(3)
    # Rank 1 is signalled at step 3; rank 0 may check step 3 before rank 1 publishes.
    assert lockstep(a, {1: 3}, order) == {0: 4, 1: 4, 2: 4}
    assert all(x.agreed_step == 3 for x in a)


def test_the_first_proposer_wins(ranks):
    a = ranks(3)
    assert not a[1].reached(5, True)  # proposes 5
    assert not a[2].reached(5, True)  # proposes 5 too: gets 5
    assert not a[0].reached(4, True)  # a rank behind proposes 4 later: gets 5
    assert [x.agreed_step for x in a] == [5, 5, 5]
    assert not a[0].reached(5, True)
    assert [x.reached(6, False) for x in a] == [True, True, True]


def test_a_later_proposer_takes_the_first_step(ranks):
    a = ranks(2)
    assert not a[0].reached(3, False)  # before rank 1 publishes 3
    assert not a[1].reached(3, True)
    # Rank 0 is signalled during step 4: it finds 3 and saves at 4 with rank 1.
    assert a[0].reached(4, True) and a[1].reached(4, False)
    assert a[0].agreed_step == 3


def test_a_rank_behind_waits_for_the_step_past_the_agreed_one(ranks):
    a = ranks(2)
    assert not a[1].reached(5, True)
    assert [a[0].reached(s, False) for s in (2, 3, 4, 5, 6)] == [False] * 4 + [True]


def test_a_rank_that_ran_past_the_agreed_step_raises(ranks):
    a = ranks(2)
    for s in range(1, 6):  # rank 0 runs ahead: no collective holds it back
        assert not a[0].reached(s, False)
    assert not a[1].reached(3, True)
    with pytest.raises(CoordinationError, match=r"rank 0 is at step 6 .* step 3 .* past step 5"):
        a[0].reached(6, False)
    with pytest.raises(CoordinationError, match="rank 0 is at step 6"):  # and at every call
        a[0].reached(7, False)
    assert a[1].reached(4, False)  # the proposer itself is fine


def test_one_lookup_per_call_until_agreed_none_after():
    coords = dict_ranks(2)
    a = [PreemptionAgreement(c, KEY) for c in coords]
    for s in range(1, 4):
        a[0].reached(s, False)
    assert coords[0].lookups == 3
    a[1].reached(3, True)
    assert coords[1].lookups == 1
    for s in range(4, 10):
        assert a[0].reached(s, False) and a[1].reached(s, False)
    assert coords[0].lookups == 4 and coords[1].lookups == 1


# ---- the manager ---------------------------------------------------------------------


def tree(step):
    return {"w": np.full(4, step, np.float32)}


def test_a_single_process_is_true_at_once(tmp_path):
    with CheckpointManager(tmp_path, save_interval_steps=100) as m:
        assert not m.reached_preemption(3)
        m.notify_preemption()
        assert m.reached_preemption(3)


def test_the_manager_of_rank_0_of_two_agrees_through_its_coordinator(tmp_path):
    # The JAX framework without jax.distributed: no preemption service runs.
    c0, c1 = dict_ranks(2)
    with CheckpointManager(tmp_path, save_interval_steps=100, coordinator=c0) as m:
        assert m._preemption is not None
        other = PreemptionAgreement(c1, m._preemption.key)  # rank 1, as its manager would
        assert not m.reached_preemption(2) and not other.reached(2, False)
        m.notify_preemption()
        assert not m.reached_preemption(3)  # publishes 3
        assert other.reached(4, False) and m.reached_preemption(4)
        assert c0.try_get(m._preemption.key) == "3"


def test_rank_0_follows_a_step_another_rank_published(tmp_path):
    c0, c1 = dict_ranks(2)
    with CheckpointManager(tmp_path, save_interval_steps=100, coordinator=c0) as m:
        assert m._preemption is not None
        assert not m.reached_preemption(6)
        assert not PreemptionAgreement(c1, m._preemption.key).reached(6, True)
        assert m.reached_preemption(7)


def test_keys_differ_per_manager(tmp_path):
    c0, _ = dict_ranks(2)
    with CheckpointManager(tmp_path / "a", coordinator=c0) as a:
        pass
    with CheckpointManager(tmp_path / "a", coordinator=c0) as b:
        pass
    with CheckpointManager(tmp_path / "b", coordinator=c0) as c:
        pass
    keys = {m._preemption.key for m in (a, b, c) if m._preemption is not None}
    assert len(keys) == 3


def test_a_running_sync_service_decides_and_the_store_is_not_read(tmp_path):
    c0, _ = dict_ranks(2)
    fw = dataclasses.replace(JAX, preemption_sync_point=lambda step: step >= 5)
    with CheckpointManager(tmp_path, coordinator=c0, framework=fw) as m:
        before = c0.lookups
        assert not m.reached_preemption(4) and m.reached_preemption(5)
        assert c0.lookups == before
