"""Staging memory is reused and bounded: a manager's saves stage into exact-size host buffers
that the next save of the same state takes again, that `close()` releases and that
`SaveOptions.host_budget` bounds (JAX); and a loop of saves leaves nothing behind that grows
with the saves (objects counted, not time), nor cycles that no collection ever sees."""

from __future__ import annotations

import gc
import urllib.parse
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import snapshard
import snapshard.gc_pause as gc_pause
import snapshard.saving.staging as staging
import snapshard.torch as st
from snapshard import CheckpointManager, SaveOptions
from snapshard.saving.staging import HostArrays, HostPool
from snapshard.torch.saving import HostBuffers


def _held(pool: HostPool[Any]) -> list[Any]:
    """The buffers a pool holds for the next save (the objects themselves)."""
    return [b for v in pool._free.values() for b in v]


def _same_objects(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(any(x is y for y in b) for x in a)


def _host_state(step: int) -> dict[str, Any]:
    """NumPy leaves, which an asynchronous save must copy (the caller may change them)."""
    return {
        "w": np.full((64, 32), step, np.float32),
        "b": np.arange(48, dtype=np.int64) + step,
        "step": step,
    }


def _host_bytes() -> int:
    return 64 * 32 * 4 + 48 * 8


# ---------------------------------------------------------------- JAX's staging pool
def test_a_managers_saves_reuse_its_exact_size_buffers_and_close_releases_them(tmp_path):
    m = CheckpointManager(tmp_path, max_to_keep=2)
    pool = m._pools.pool(HostArrays)
    m.save(1, _host_state(1))
    m.wait_until_finished()
    first = _held(pool)
    assert sorted(b.nbytes for b in first) == [48 * 8, 64 * 32 * 4]  # one per item, exact
    assert m.save_timings()[1].bytes_staged == pool.cached_bytes() == _host_bytes()
    for step in (2, 3, 4):
        m.save(step, _host_state(step))
        m.wait_until_finished()
        assert _same_objects(_held(pool), first)  # the very buffers, taken again
        assert pool.cached_bytes() == _host_bytes()
    watched = [weakref.ref(b) for b in first]
    del first
    m.close()
    assert pool.cached_bytes() == 0
    assert all(w() is None for w in watched)  # nothing else keeps them: freed
    for step in (3, 4):  # (the two kept)
        np.testing.assert_array_equal(snapshard.load(tmp_path / str(step))["w"], step)


def test_a_save_without_a_manager_keeps_no_buffers(tmp_path):
    from snapshard.jax.save_adapter import JaxAdapter

    assert JaxAdapter().pool is None  # no owner: copies allocated, freed with the save
    snapshard.save_async(tmp_path / "c", _host_state(1)).wait()
    assert snapshard.load(tmp_path / "c")["step"] == 1


def test_copied_device_arrays_reuse_buffers_within_the_host_budget(tmp_path, monkeypatch):
    """Where CPU arrays cannot be staged as views they are copied, into the pool's buffers,
    and the host budget bounds those copies (the rest is copied in the background phase)."""
    monkeypatch.setattr(staging, "_views_safe", lambda asynchronous: not asynchronous)
    one = 128 * 64 * 4
    budget = SaveOptions(host_budget=one)
    with CheckpointManager(tmp_path, max_to_keep=2, save_options=budget) as m:
        pool = m._pools.pool(HostArrays)
        first: list[Any] = []
        for step in range(1, 5):
            state = {"a": jnp.full((128, 64), step, jnp.float32), "b": jnp.ones((128, 64)) * step}
            m.save(step, state)
            m.wait_until_finished()
            assert m.save_timings()[step].bytes_staged == one  # one copy within the budget
            assert pool.cached_bytes() == one
            if step == 1:
                first = _held(pool)
            assert _same_objects(_held(pool), first)
        out = m.restore(4)
    np.testing.assert_array_equal(out["a"], np.full((128, 64), 4, np.float32))
    np.testing.assert_array_equal(out["b"], np.full((128, 64), 4, np.float32))
    assert pool.cached_bytes() == 0


def test_a_changed_state_keeps_only_what_the_last_save_took(tmp_path):
    with CheckpointManager(tmp_path) as m:
        pool = m._pools.pool(HostArrays)
        m.save(1, {"w": np.zeros(1000, np.float32), "v": np.zeros(10, np.float32)})
        m.save(2, {"w": np.zeros(2000, np.float32)})
        m.wait_until_finished()
        assert [b.nbytes for b in _held(pool)] == [8000]


# ---------------------------------------------------------------- torch's host buffers
def test_a_torch_managers_saves_reuse_its_buffers_and_close_releases_them(tmp_path):
    process_pool = st.saving._buffers
    before = _held(process_pool)
    w, b = torch.zeros(64, 32), torch.zeros(48, dtype=torch.int64)
    m = st.CheckpointManager(tmp_path, max_to_keep=2)
    pool = m._pools.pool(HostBuffers)
    first: list[Any] = []
    for step in range(1, 5):
        w.add_(1)
        b.add_(1)
        m.save(step, {"w": w, "b": b, "step": step})
        m.wait_until_finished()
        assert m.save_timings()[step].bytes_staged == pool.cached_bytes() == _host_bytes()
        if step == 1:
            first = _held(pool)
            assert sorted(x[0].nbytes for x in first) == [48 * 8, 64 * 32 * 4]
        assert _same_objects(_held(pool), first)
    assert _same_objects(_held(process_pool), before)  # save_async's pool is not the manager's
    watched = [weakref.ref(x[0]) for x in first]
    del first
    m.close()
    assert pool.cached_bytes() == 0 and all(r() is None for r in watched)
    target = {"w": torch.zeros(64, 32), "b": torch.zeros(48, dtype=torch.int64), "step": 0}
    with st.CheckpointManager(tmp_path) as r:
        r.restore(4, target)
    assert torch.equal(target["w"], torch.full((64, 32), 4.0)) and target["step"] == 4


def test_a_failed_save_gives_its_buffers_back_to_the_managers_pool(tmp_path, monkeypatch):
    from snapshard.saving import entry

    real = entry.finish_here  # (inside finish, which gives the buffers back however it ends)
    # (injected into this process: the background phase runs in its threads)
    monkeypatch.setenv("SNAPSHARD_BACKGROUND", "thread")

    def failing(prep: Any) -> Any:
        if prep.extra["step"] == 2:
            raise OSError("disk full")
        return real(prep)

    monkeypatch.setattr(entry, "finish_here", failing)
    w = torch.ones(16)
    m = st.CheckpointManager(tmp_path)
    pool = m._pools.pool(HostBuffers)
    m.save(1, {"w": w})
    m.wait_until_finished()
    first = _held(pool)
    m.save(2, {"w": w})
    with pytest.raises(snapshard.BackgroundSaveError, match="step 2 failed"):
        m.wait_until_finished()
    assert _same_objects(_held(pool), first)  # back, though the save failed
    m.save(3, {"w": w})
    m.close()
    assert m.all_steps() == [1, 3] and pool.cached_bytes() == 0


def test_buffers_given_back_after_close_are_dropped():
    pool = HostBuffers()
    buf = pool.take(64, False)
    pool.close()
    pool.give_back([buf])  # a save that ended after its manager closed
    assert pool.cached_bytes() == 0
    assert pool.take(64, False)[0].nbytes == 64  # still lends


def test_a_borrower_gives_back_all_its_save_took():
    pool = HostArrays()
    first = pool.borrower()
    a, b = first.take(64), first.take(128)
    assert first.taken == [a, b] and pool.cached_bytes() == 0  # lent out
    first.release()
    assert _same_objects(_held(pool), [a, b]) and first.taken == []
    second = pool.borrower()
    assert second.take(64) is a  # the same buffer again
    assert _same_objects(_held(pool), [b])
    second.release()  # what the last save took, and only that
    assert _same_objects(_held(pool), [a])
    pool.borrower().release()  # a save that took nothing: nothing held for the next
    assert pool.cached_bytes() == 0


# ---------------------------------------------------------------- nothing grows
def _objects() -> int:
    gc.collect()
    urllib.parse.clear_cache()  # (the standard library's own bounded cache of parsed urls)
    return len(gc.get_objects())


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_fifty_saves_leave_no_objects_behind(tmp_path, monkeypatch, framework):
    import snapshard.manager.writer as writer

    monkeypatch.setattr(writer, "REPORTS_KEPT", 5)  # (kept up to 100 saves by default)
    if framework == "jax":
        make, cls = CheckpointManager, HostArrays

        def state(step: int) -> dict[str, Any]:
            return {**_host_state(step), "d": jnp.full((16, 16), step, jnp.float32)}
    else:
        make, cls = st.CheckpointManager, HostBuffers  # type: ignore[assignment]

        def state(step: int) -> dict[str, Any]:
            return {"w": torch.full((64, 32), float(step)), "step": step}

    with make(tmp_path, max_to_keep=2) as m:
        for step in range(10):
            m.save(step, state(step))
        m.wait_until_finished()
        before = _objects()
        staged = m._pools.pool(cls).cached_bytes()
        for step in range(10, 60):
            m.save(step, state(step))
        m.wait_until_finished()
        assert gc.collect() < 50  # no save leaves a reference cycle behind
        grown = _objects() - before
        assert grown < 50, f"{grown} more objects after 50 saves"  # (~300 per save before)
        assert m._pools.pool(cls).cached_bytes() == staged > 0
        assert len(m.save_timings()) == len(m.tier_reports()) == 5
    assert m._pools.cached_bytes() == 0


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_managers_saves_leave_no_coordination_name_per_step(tmp_path, framework):
    """A save's rendezvous is named by the count of saves to its location that this process
    keeps (coordination/rendezvous.namespace): a manager's saves are counted under its
    directory, not each under its step's own location, which would be one more entry,
    kept for as long as the process runs, for every step saved."""
    from snapshard.coordination import rendezvous

    if framework == "jax":
        make, state = CheckpointManager, lambda step: {"x": np.full(4, step)}
    else:
        make, state = st.CheckpointManager, lambda step: {"w": torch.full((4,), float(step))}
    with make(tmp_path, max_to_keep=2) as m:
        m.save(0, state(0))
        m.wait_until_finished()
        before = len(rendezvous._counts)
        for step in range(1, 21):
            m.save(step, state(step))
        m.wait_until_finished()
        assert len(rendezvous._counts) == before
        assert m.all_steps() == [19, 20]
    assert m.restore(20)["x" if framework == "jax" else "w"][0] == 20


def test_reports_are_kept_for_the_newest_saves(tmp_path, monkeypatch):
    import snapshard.manager.writer as writer

    monkeypatch.setattr(writer, "REPORTS_KEPT", 3)
    with CheckpointManager(tmp_path, max_to_keep=1) as m:
        for step in range(6):
            m.save(step, {"x": np.zeros(4)})
        m.wait_until_finished()
        assert sorted(m.save_timings()) == sorted(m.tier_reports()) == [3, 4, 5]
        assert m.recommended_save_interval(3600.0) > 0


# ---------------------------------------------------------------- the collector's pace
class _Node:
    def __init__(self) -> None:
        self.other: object = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def collector_on(monkeypatch):
    was = gc.isenabled()
    gc.enable()
    gc.collect()
    monkeypatch.setattr(gc_pause, "_long_lived", 0)  # a small heap: CPython's floor applies
    yield
    (gc.enable if was else gc.disable)()


def test_cycles_left_between_paused_calls_are_collected_at_the_collectors_pace(collector_on):
    """Every paused call moves what is young into the oldest generation and sets the count
    that starts collections back to 0: a program that makes fewer objects than a young
    collection waits for between two saves would otherwise never collect a cycle again."""
    watched = []
    floor = gc.get_threshold()[0] * gc.get_threshold()[1]
    for _ in range(2 * floor // 100 + 20):
        watched += [_cycle() for _ in range(50)]  # 100 objects a step: no young collection
        with gc_pause.collection_paused():
            pass
    early = watched[: len(watched) // 2]
    assert sum(w() is None for w in early) == len(early)


def test_a_managers_saves_collect_what_its_steps_leave(tmp_path, collector_on):
    watched = []
    with CheckpointManager(tmp_path, max_to_keep=2) as m:
        for step in range(60):
            watched += [_cycle() for _ in range(100)]  # fewer objects than a young collection
            m.save(step, {"x": np.full(8, step)})
        m.wait_until_finished()
        early = watched[:500]
        assert sum(w() is None for w in early) == len(early)


def test_asynchronous_saves_collect_what_their_callers_leave(tmp_path, collector_on):
    watched = []
    for step in range(60):
        watched += [_cycle() for _ in range(100)]
        snapshard.save_async(tmp_path / str(step), {"x": np.full(8, step)}).wait()
    early = watched[:500]
    assert sum(w() is None for w in early) == len(early)


def test_a_collector_the_program_turned_off_is_never_run(collector_on):
    gc.disable()
    try:
        ref = _cycle()
        for _ in range(100):
            _ = [_Node() for _ in range(200)]
            with gc_pause.collection_paused():
                pass
        assert not gc_pause.collect_if_due()
        assert ref() is not None
    finally:
        gc.collect()


def test_jax_arrays_saved_by_the_manager_stay_zero_copy_on_cpu(tmp_path):
    """On CPU a jax.Array is staged as a view (no copy, no buffer) where that is safe."""
    from snapshard.frameworks import jax_wing

    if not jax_wing().cpu_donation_keeps_memory():
        pytest.skip("this JAX copies CPU arrays")
    with CheckpointManager(tmp_path) as m:
        m.save(1, {"d": jax.device_put(np.ones((32, 32), np.float32))})
        m.wait_until_finished()
        assert m.save_timings()[1].bytes_staged == 0
        assert m._pools.pool(HostArrays).cached_bytes() == 0


def test_what_a_saves_blocking_phase_leaves_alive_does_not_count_toward_a_collection(
    collector_on,
):
    """A transient pause (a save's blocking phase) counts the young objects it found on
    entry, not those it made and left alive for the save's background phase."""
    gc.collect()
    with gc_pause.collection_paused():  # (takes in the full collection just made)
        pass
    moved = gc_pause._moved
    kept = []
    with gc_pause.collection_paused(transient=True):
        kept += [_Node() for _ in range(5000)]
    assert gc_pause._moved - moved < 1000
    with gc_pause.collection_paused():
        kept += [_Node() for _ in range(5000)]
    assert gc_pause._moved - moved >= 5000
