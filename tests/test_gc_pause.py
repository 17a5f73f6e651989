"""The cyclic collector is paused inside loads and saves, and left as it was found."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest

import snapshard
import snapshard.jax.load
import snapshard.saving.blocking
from snapshard.gc_pause import collection_paused


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_nested_pauses_resume_at_the_outermost_even_after_an_error() -> None:
    with collection_paused():
        assert not gc.isenabled()
        with pytest.raises(RuntimeError), collection_paused():
            raise RuntimeError("inner")
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off() -> None:
    gc.disable()
    with collection_paused():
        pass
    assert not gc.isenabled()


def test_overlapping_pauses_of_two_threads_resume_once_both_end() -> None:
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collection_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    with collection_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause still runs
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_load_and_save_run_paused_and_leave_the_collector_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, bool] = {}

    def probe(module: object, name: str) -> None:
        real = getattr(module, name)

        def wrapped(*args: object, **kwargs: object) -> object:
            seen[name] = gc.isenabled()
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    probe(snapshard.saving.blocking, "plan_writes")
    probe(snapshard.jax.load, "open_for_load")
    snapshard.save(tmp_path / "c", {"a": np.arange(6.0)})
    assert gc.isenabled()
    out = snapshard.load(tmp_path / "c", {"a": np.zeros(6)})
    np.testing.assert_array_equal(out["a"], np.arange(6.0))
    assert gc.isenabled()
    assert seen == {"plan_writes": False, "open_for_load": False}


class _Node:
    """A tracked object that can sit in a cycle."""

    def __init__(self) -> None:
        self.other: object = None


def _generation_of(obj: object) -> int | None:
    """The generation that holds `obj`, or None (frozen or untracked)."""
    for g in range(3):
        if any(o is obj for o in gc.get_objects(generation=g)):
            return g
    return None


def test_what_a_paused_call_leaves_alive_goes_to_the_oldest_generation() -> None:
    with collection_paused():
        kept = _Node()
    assert gc.isenabled()
    assert _generation_of(kept) == 2  # not traversed by the young collections
    assert gc.get_freeze_count() == 0


def test_cycles_made_while_paused_are_still_collected() -> None:
    import weakref

    with collection_paused():
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        del a, b
    gc.collect()
    assert ref() is None


def test_an_asynchronous_save_keeps_what_existed_out_of_collections_until_it_ends(
    tmp_path: Path,
) -> None:
    before = _Node()
    pending = snapshard.save_async(tmp_path / "c", {"a": np.arange(6.0)})
    pending.wait()
    assert gc.get_freeze_count() == 0  # released once the background phase ended
    assert _generation_of(before) == 2
    assert gc.isenabled()


def test_a_manager_s_save_keeps_what_existed_out_of_collections_while_it_drains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import snapshard.jax.manager as jax_manager

    before = _Node()
    seen = []
    real = jax_manager.finish

    def finish(prep):
        seen.append((gc.get_freeze_count(), _generation_of(before)))
        return real(prep)

    monkeypatch.setattr(jax_manager, "finish", finish)
    manager = snapshard.CheckpointManager(tmp_path / "steps")
    manager.save(1, {"a": np.arange(6.0)})
    manager.wait_until_finished()
    assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1] is None  # frozen while it drained
    assert gc.get_freeze_count() == 0 and _generation_of(before) == 2
    manager.close()


@pytest.mark.parametrize("background", ["thread", "process"])
def test_a_finished_save_lets_its_items_and_leaves_go_in_its_own_thread(
    tmp_path: Path, background: str
) -> None:
    tree = {f"a{i}": np.full(4, i, np.float32) for i in range(600)}
    save = snapshard.save_async(tmp_path / "c", tree, snapshard.SaveOptions(background=background))
    save.wait()
    assert save._prep.items == [] and save._prep.leaves == []  # freed a slice at a time
    assert snapshard.load(tmp_path / "c")["a599"].tolist() == [599] * 4


def test_two_overlapping_frozen_holders_release_at_the_last() -> None:
    from snapshard.gc_pause import Frozen

    first = Frozen()
    obj = _Node()
    second = Frozen()
    assert gc.get_freeze_count() > 0 and _generation_of(obj) is None
    first.release()
    first.release()  # twice is harmless
    assert gc.get_freeze_count() > 0  # the second still holds them
    second.release()
    assert gc.get_freeze_count() == 0 and _generation_of(obj) == 2


def test_objects_the_program_froze_itself_are_left_frozen(tmp_path: Path) -> None:
    mine = _Node()
    gc.freeze()
    try:
        with collection_paused():
            pass
        pending = snapshard.save_async(tmp_path / "c", {"a": np.arange(6.0)})
        pending.wait()
        assert _generation_of(mine) is None  # still frozen: not ours to thaw
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
