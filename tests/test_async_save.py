"""save_async: the blocking phase, donation after it returns, the host budget, errors."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

import snapshard
from snapshard import SaveOptions
from snapshard.jax import arrays as jax_arrays
from snapshard.storage import local, local_files

from conftest import mesh, sharded


def test_views_of_cpu_arrays_survive_donation():
    # The zero-copy staging on CPU relies on this; where it fails we copy instead.
    assert jax_arrays.cpu_donation_keeps_memory()


def test_donating_arrays_right_after_save_async_returns_keeps_the_saved_values(ckpt, monkeypatch):
    m = mesh(2, 4)
    x = sharded(np.arange(256 * 64, dtype=np.float32).reshape(256, 64), m, None, "model")
    expected = np.asarray(x).copy()
    gate = threading.Event()
    real_write = local_files.LocalFileWriter.write

    def slow_write(self, data):
        gate.wait(10)  # hold the background phase until the arrays were donated
        real_write(self, data)

    monkeypatch.setattr(local_files.LocalFileWriter, "write", slow_write)
    handle = snapshard.save_async(ckpt, {"x": x})
    assert not handle.done()
    step = jax.jit(lambda a: a * 0 - 1, donate_argnums=0)
    other = sharded(np.ones((256, 64), np.float32), m, None, "model")
    step(other).block_until_ready()
    assert other.is_deleted()  # donation is real on this backend...
    y = step(x)
    assert np.all(np.asarray(y) == -1)  # ...and ran on the array being saved
    gate.set()
    timings = handle.wait(60)
    assert handle.done() and timings.total_s >= timings.blocking_s > 0
    assert timings.bytes_staged == 0  # zero-copy views on CPU
    assert np.array_equal(snapshard.load(ckpt)["x"], expected)


def test_numpy_leaves_are_copied_so_later_changes_do_not_leak_in(ckpt, monkeypatch):
    gate = threading.Event()
    real_write = local_files.LocalFileWriter.write
    monkeypatch.setattr(
        local_files.LocalFileWriter, "write", lambda self, d: (gate.wait(10), real_write(self, d))
    )
    host = np.zeros(1000, np.float32)
    handle = snapshard.save_async(ckpt, {"h": host})
    host[:] = 7
    gate.set()
    handle.wait(60)
    assert np.all(snapshard.load(ckpt)["h"] == 0)


def test_host_budget_defers_copies_beyond_it(ckpt, monkeypatch):
    # Force the copying path (as on an accelerator) to exercise the budget.
    monkeypatch.setattr(jax_arrays, "_cpu_donation_safe", False)
    m = mesh(2, 4)
    tree = {f"w{i}": sharded(np.full((64, 64), i, np.float32), m, None, "model") for i in range(4)}
    handle = snapshard.save_async(ckpt, tree, options=SaveOptions(host_budget=2 * 64 * 64 * 4))
    t = handle.wait(60)
    assert 0 < t.bytes_staged <= 2 * 64 * 64 * 4
    out = snapshard.load(ckpt)
    for i in range(4):
        assert np.all(out[f"w{i}"] == i)


def test_a_deferred_array_deleted_before_its_copy_fails_with_a_clear_error(ckpt, monkeypatch):
    monkeypatch.setattr(jax_arrays, "_cpu_donation_safe", False)
    gate = threading.Event()
    real_open = local.LocalStorage.open_writer  # held before any item is copied or written
    monkeypatch.setattr(
        local.LocalStorage, "open_writer", lambda self, n: (gate.wait(10), real_open(self, n))[1]
    )
    m = mesh(2, 4)
    a = sharded(np.ones((64, 64), np.float32), m, None, "model")
    b = sharded(np.ones((64, 64), np.float32), m, None, "model")
    # In threads (the gate holds them here): tests/test_writer_process.py has the writer's.
    opts = SaveOptions(host_budget=64 * 64 * 4, writers=1, background="thread")
    handle = snapshard.save_async(ckpt, {"a": a, "b": b}, options=opts)
    b.delete()
    a.delete()
    gate.set()
    with pytest.raises(snapshard.SnapshardError, match=r"leaf '[ab]'.*deleted"):
        handle.wait(60)
    assert not ckpt.exists()


def test_background_failure_is_raised_by_wait(ckpt, monkeypatch):
    def boom(self, data):
        raise PermissionError(13, "Permission denied (injected)")

    # (injected into this process: the background phase runs in its threads)
    monkeypatch.setenv("SNAPSHARD_BACKGROUND", "thread")
    monkeypatch.setattr(local_files.LocalFileWriter, "write", boom)
    handle = snapshard.save_async(ckpt, {"x": np.ones(10)})
    with pytest.raises(PermissionError, match="injected"):
        handle.wait(60)
    assert not ckpt.exists()


def test_only_asynchronous_saves_wait_for_the_staging_check(ckpt, tmp_path, monkeypatch):
    """A synchronous save shares CPU buffers without the donation check (nothing can
    donate them before it returns); an asynchronous one asks the check first."""
    from snapshard.frameworks import jax_wing

    asked: list[bool] = []
    check = lambda: asked.append(True) or True  # noqa: E731
    monkeypatch.setattr(jax_wing(), "cpu_donation_keeps_memory", check)  # as staging asks it
    x = sharded(np.arange(64.0 * 64).reshape(64, 64), mesh(2, 4), None, "model")
    t = snapshard.save(ckpt, {"x": x})
    assert asked == [] and t.bytes_staged == 0
    t = snapshard.save_async(tmp_path / "async", {"x": x}).wait(60)
    assert asked and t.bytes_staged == 0
    assert np.array_equal(snapshard.load(ckpt)["x"], np.asarray(x))


@pytest.mark.parametrize("budget", [None, 1 << 20])
def test_fully_replicated_arrays_are_copied_once_each(ckpt, monkeypatch, budget):
    """A fully replicated array is staged through the array itself (one copy, not one
    object per device's copy): deleted right after save_async returns, every copied byte
    is still saved; beyond the budget, the copy is made later."""
    monkeypatch.setattr(jax_arrays, "_cpu_donation_safe", False)  # the copying path
    m = mesh(2, 4)
    values = {f"r{i}": np.arange(1 << 18, dtype=np.float32).reshape(512, 512) + i for i in range(3)}
    tree = {k: sharded(v, m, None, None) for k, v in values.items()}
    assert all(a.is_fully_replicated for a in tree.values())
    from snapshard.jax import save_adapter as jax_save

    staged: list[int] = []
    real_stage = jax_save.stage
    monkeypatch.setattr(
        jax_save, "stage", lambda *a, **k: (r := real_stage(*a, **k), staged.append(len(r[0])))[0]
    )
    handle = snapshard.save_async(ckpt, tree, options=SaveOptions(host_budget=budget, writers=1))
    assert staged == [3]  # one item (one copy) per array
    if budget is None:
        for a in tree.values():
            a.delete()
    t = handle.wait(60)
    assert t.bytes_staged == (sum(v.nbytes for v in values.values()) if budget is None else budget)
    out = snapshard.load(ckpt)
    for k, v in values.items():
        np.testing.assert_array_equal(out[k], v)
