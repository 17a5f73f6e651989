"""The cyclic collector is paused inside loads and saves, and left as it was found."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import numpy as np
import pytest

import snapshard
import snapshard.restore
import snapshard.saving
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

    probe(snapshard.saving, "plan_writes")
    probe(snapshard.restore, "open_source")
    snapshard.save(tmp_path / "c", {"a": np.arange(6.0)})
    assert gc.isenabled()
    out = snapshard.load(tmp_path / "c", {"a": np.zeros(6)})
    np.testing.assert_array_equal(out["a"], np.arange(6.0))
    assert gc.isenabled()
    assert seen == {"plan_writes": False, "open_source": False}
