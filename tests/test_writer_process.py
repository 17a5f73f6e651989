"""The background phase in a writer process (SaveOptions(background="process")): the same
checkpoints as in threads, errors raised with their own types, a writer killed mid-save
fails the save on every process and leaves nothing behind, and the next save works."""

from __future__ import annotations

import logging
import os
import re
import signal
import time

import numpy as np
import pytest

import multiproc
import snapshard
from snapshard import SaveOptions
from snapshard.coordination.base import SingleProcessCoordinator
from snapshard.errors import CheckpointExistsError, SnapshardError
from snapshard.saving import entry, writer_exposure, writer_process

pytestmark = pytest.mark.timeout(180)

PROCESS = SaveOptions(background="process")


def _writer_pid() -> int:
    assert writer_process._writer is not None
    return writer_process._writer.proc.pid


def _leftovers(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if "snapshard-tmp" in n)


def test_saves_in_a_writer_process_load_back_equal_and_reuse_the_writer(tmp_path, writer_runs):
    tree = {"a": np.arange(12.0).reshape(3, 4), "b": {"c": np.int32(5)}, "step": 3}
    snapshard.save_async(tmp_path / "0", tree, PROCESS).wait()
    first = _writer_pid()
    assert first != os.getpid()
    # A changed tree: the writer is sent its new leaves.
    tree2 = {**tree, "d": np.ones((100, 7), np.float32), "step": 4}
    timings = snapshard.save_async(tmp_path / "1", tree2, PROCESS).wait()
    assert _writer_pid() == first  # started once, kept
    assert timings.bytes_written == 12 * 8 + 4 + 100 * 7 * 4 and timings.total_s > 0
    out = snapshard.load(tmp_path / "1")
    np.testing.assert_array_equal(out["d"], tree2["d"])
    np.testing.assert_array_equal(out["a"], tree["a"])
    assert out["step"] == 4 and out["b"]["c"] == 5
    assert snapshard.load(tmp_path / "0")["step"] == 3
    assert len(writer_runs) == 2


def test_the_caller_may_change_its_arrays_once_the_blocking_phase_returned(tmp_path, writer_runs):
    a = np.arange(1000, dtype=np.float64)
    b = np.arange(600.0).reshape(20, 30)[:, ::3]  # not contiguous: copied for the writer
    save = snapshard.save_async(tmp_path / "x", {"a": a, "b": b}, PROCESS)
    a[:] = -1
    save.wait()
    out = snapshard.load(tmp_path / "x")
    np.testing.assert_array_equal(out["a"], np.arange(1000.0))
    np.testing.assert_array_equal(out["b"], np.arange(600.0).reshape(20, 30)[:, ::3])
    assert writer_runs == [str(tmp_path / "x")]


def test_jax_cpu_shards_are_read_from_their_own_buffers(tmp_path, writer_runs):
    jax = pytest.importorskip("jax")
    x = jax.numpy.arange(4096.0, dtype=jax.numpy.float32).reshape(64, 64)
    t = snapshard.save_async(tmp_path / "x", {"x": x}, PROCESS).wait()
    assert t.bytes_staged == 0  # zero-copy views in the blocking phase, read by the writer
    np.testing.assert_array_equal(snapshard.load(tmp_path / "x")["x"], np.asarray(x))
    assert len(writer_runs) == 1


def test_without_the_data_offset_each_arrays_address_is_sent(tmp_path, writer_runs, monkeypatch):
    monkeypatch.setattr(writer_exposure, "_DATA_OFFSET", None)
    a = np.arange(100.0)
    snapshard.save_async(tmp_path / "x", {"a": a}, PROCESS).wait()
    np.testing.assert_array_equal(snapshard.load(tmp_path / "x")["a"], a)
    assert len(writer_runs) == 1


def test_a_writer_error_is_raised_with_its_own_type_and_the_writer_stays(tmp_path):
    snapshard.save(tmp_path / "x", {"a": np.ones(3)})
    save = snapshard.save_async(tmp_path / "x", {"a": np.zeros(3)}, PROCESS)
    with pytest.raises(CheckpointExistsError, match="already exists"):
        save.wait()
    pid = _writer_pid()
    np.testing.assert_array_equal(snapshard.load(tmp_path / "x")["a"], np.ones(3))
    assert _leftovers(tmp_path) == []
    snapshard.save_async(tmp_path / "y", {"a": np.zeros(3)}, PROCESS).wait()
    assert _writer_pid() == pid


class _KillsTheWriter(SingleProcessCoordinator):
    """Kills the writer process when it reports its files written: mid-save, after every
    data file and before the commit."""

    def set(self, key: str, value: str) -> None:
        if "/written/" in key:
            os.kill(_writer_pid(), signal.SIGKILL)
            writer_process._writer.proc.wait()  # type: ignore[union-attr]
            raise OSError("killed")
        super().set(key, value)


def test_a_writer_killed_mid_save_fails_the_save_and_leaves_nothing(tmp_path):
    snapshard.save_async(tmp_path / "warm", {"a": np.ones(4)}, PROCESS).wait()
    killed = _writer_pid()
    tree = {"a": np.arange(4096.0), "b": np.ones((64, 64), np.float32)}
    save = snapshard.save_async(tmp_path / "x", tree, PROCESS, coordinator=_KillsTheWriter())
    with pytest.raises(
        SnapshardError, match=r"save to .*x: the writer process was killed by SIGKILL"
    ):
        save.wait()
    assert not (tmp_path / "x").exists() and _leftovers(tmp_path) == []
    snapshard.save_async(tmp_path / "x", tree, PROCESS).wait()  # a new writer
    assert _writer_pid() != killed
    np.testing.assert_array_equal(snapshard.load(tmp_path / "x")["a"], tree["a"])


class _KillsTheWriterAfterItsCommit(SingleProcessCoordinator):
    """Kills the writer as it removes the save's keys: after the rename, before it says
    it is done."""

    def delete(self, prefix, keys=None) -> None:
        # (not the reports' keys, which process 0 removes as it gathers them, before the commit)
        if prefix.startswith("snapshard/save/") and not prefix.endswith("/written"):
            os.kill(_writer_pid(), signal.SIGKILL)
            writer_process._writer.proc.wait()  # type: ignore[union-attr]
            raise OSError("killed")
        super().delete(prefix, keys)


def test_a_writer_killed_after_the_rename_leaves_its_save_committed(tmp_path):
    snapshard.save(tmp_path / "x", {"a": np.zeros(4)})
    coord = _KillsTheWriterAfterItsCommit()
    t = snapshard.save_async(
        tmp_path / "x", {"a": np.ones(4)}, PROCESS, overwrite=True, coordinator=coord
    ).wait()
    assert t.total_s > 0
    np.testing.assert_array_equal(snapshard.load(tmp_path / "x")["a"], np.ones(4))
    assert _leftovers(tmp_path) == []


def test_a_writer_killed_at_the_commit_guard_commits_nothing(tmp_path):
    from snapshard.storage import storage_for

    storage = storage_for(tmp_path / "x")

    def guard() -> None:  # runs here, asked by the writer just before its commit
        os.kill(_writer_pid(), signal.SIGKILL)
        writer_process._writer.proc.wait()  # type: ignore[union-attr]

    storage.commit_guard = guard
    save = snapshard.save_async(storage, {"a": np.ones(10)}, PROCESS)
    with pytest.raises(SnapshardError, match="the writer process was killed by SIGKILL"):
        save.wait()
    assert not (tmp_path / "x").exists() and _leftovers(tmp_path) == []


def test_incremental_saves_refer_to_their_base_from_the_writer(tmp_path, writer_runs):
    from snapshard.saving.incremental import UnprovableBaseWarning

    frozen = {"emb": np.arange(4096.0).reshape(64, 64), "w": np.ones((100, 7), np.float32)}
    snapshard.save(tmp_path / "1", {**frozen, "x": np.zeros(8)}, SaveOptions(hashes=True))
    t = snapshard.save_async(
        tmp_path / "2", {**frozen, "x": np.ones(8)}, PROCESS, base=tmp_path / "1"
    ).wait()
    assert t.bytes_written == 8 * 8  # only what changed
    out = snapshard.load(tmp_path / "2")
    np.testing.assert_array_equal(out["emb"], frozen["emb"])
    assert out["x"].tolist() == [1.0] * 8
    # A warning raised in the writer is raised here: a base without hashes says so.
    snapshard.save(tmp_path / "3", frozen)
    with pytest.warns(UnprovableBaseWarning, match=r"no xxh3-128 content hashes for \d+ bytes"):
        t = snapshard.save_async(tmp_path / "4", frozen, PROCESS, base=tmp_path / "3").wait()
    assert t.bytes_written == 64 * 64 * 8 + 100 * 7 * 4
    assert writer_runs == [str(tmp_path / n) for n in ("2", "4")]


def test_a_save_started_while_the_writer_is_busy_runs_in_threads(tmp_path, writer_runs):
    big = {"a": np.ones((1024, 1024), np.float32)}
    first = snapshard.save_async(tmp_path / "1", big, PROCESS)
    second = snapshard.save_async(tmp_path / "2", {"b": np.arange(5)}, PROCESS)
    first.wait()
    second.wait()
    assert snapshard.load(tmp_path / "2")["b"].tolist() == [0, 1, 2, 3, 4]
    assert float(snapshard.load(tmp_path / "1")["a"].sum()) == 1024 * 1024
    assert len(writer_runs) == 1  # (whichever asked first: the two background threads race)


def test_synchronous_saves_stay_in_the_calling_thread(tmp_path, monkeypatch):
    used = []
    monkeypatch.setattr(entry, "finish_in_writer", lambda prep: used.append(prep) or None)
    snapshard.save(tmp_path / "x", {"a": np.ones(3)}, PROCESS)
    assert used == []
    # the same patch sees an asynchronous save ask for the writer (None: it runs in threads)
    snapshard.save_async(tmp_path / "y", {"a": np.ones(3)}, PROCESS).wait()
    assert len(used) == 1


@pytest.mark.parametrize(
    ("victim", "when"), [(-1, "-"), (0, "report"), (1, "report"), (1, "outcome")]
)
def test_two_processes_with_writers_and_one_killed_mid_save(tmp_path, victim, when):
    """A writer killed as it reports its files fails the save everywhere; one killed as it
    waits for process 0's outcome (its files reported) leaves the save to commit."""
    procs = multiproc.run("writer_process_save.py", 2, 2, tmp_path, victim, when, timeout=150)
    for p in procs:
        r = p.result()
        assert r["second_equal"], r
        assert all(w is not None and w != r["me"] for w in r["writers"])
        committed = victim < 0 or when == "outcome"
        assert r["listing"] == (["0", "1"] if committed else ["1"]), r
        if committed:
            assert r["first"]["ok"], r
            assert (r["writers"][0] == r["writers"][1]) == (p.process_id != victim)
            continue
        assert not r["first"]["ok"]
        assert "the writer process was killed by SIGKILL" in r["first"]["error"], r
        # the victim's writer is started again; the other's is kept
        assert (r["writers"][0] != r["writers"][1]) == (p.process_id == victim)


def test_a_manager_saves_every_step_through_its_writer(tmp_path):
    manager = snapshard.CheckpointManager(tmp_path / "steps", save_options=PROCESS)
    for step in range(3):
        manager.save(step, {"w": np.full((8, 8), step, np.float32), "step": step})
    manager.wait_until_finished()
    assert manager.all_steps() == [0, 1, 2]
    out = manager.restore(2)
    assert out["step"] == 2 and float(out["w"][0, 0]) == 2.0
    manager.close()
    assert _writer_pid() != os.getpid()


def test_a_manager_starts_the_writer_when_it_is_made(tmp_path, writer_runs):
    writer_process.stop_writer()
    manager = snapshard.CheckpointManager(tmp_path / "steps", save_options=PROCESS)
    deadline = time.monotonic() + 60
    while writer_process._writer is None and time.monotonic() < deadline:
        time.sleep(0.01)  # started in a thread of its own, before any save
    started = _writer_pid()
    manager.save(1, {"a": np.ones(3)})
    manager.close()
    assert _writer_pid() == started and len(writer_runs) == 1


def test_torch_state_dicts_through_the_writer(tmp_path):
    torch = pytest.importorskip("torch")
    import snapshard.torch as sst

    sd = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "b": torch.ones(3)}
    save = sst.save_async(tmp_path / "t", sd, PROCESS)
    sd["w"].zero_()  # after the blocking phase: the checkpoint has the values before
    save.wait()
    out = sst.load(tmp_path / "t", {"w": torch.empty(8, 8), "b": torch.empty(3)})
    assert torch.equal(out["w"], torch.arange(64, dtype=torch.float32).reshape(8, 8))


@pytest.fixture
def through_the_window(monkeypatch):
    """Writers that read through the shared window (as where process_vm_readv is missing),
    one of 64 KiB: several requests per save, a large item in pieces."""
    writer_process.stop_writer()
    monkeypatch.setattr(writer_process, "_WINDOW_ONLY", True)
    monkeypatch.setattr(writer_exposure, "_WINDOW_BYTES", 1 << 16)
    yield
    writer_process.stop_writer()


@pytest.mark.parametrize("pwritev", ["works", "refused"])
def test_a_writer_that_cannot_read_this_process_reads_through_a_window(
    tmp_path, writer_runs, caplog, through_the_window, monkeypatch, pwritev
):
    if pwritev == "refused":  # a file system that refuses it: copied through the mapping
        monkeypatch.setattr(writer_exposure, "_pwritev", lambda *args: -1)
    tree = {f"s{i}": np.arange(i, i + 300, dtype=np.float32) for i in range(300)}
    tree |= {
        "big": np.arange(100_000.0),  # 800 KB: in window-sized pieces
        "strided": np.arange(600.0).reshape(20, 30)[:, ::3],
        "empty": np.zeros((0, 3)),
        "step": 7,
    }
    with caplog.at_level(logging.INFO, "snapshard"):
        for name in ("0", "1"):
            snapshard.save_async(tmp_path / name, tree, PROCESS).wait()
    assert any("through a shared window: asked to" in r.getMessage() for r in caplog.records)
    assert writer_process._writer is not None and writer_process._writer.exposure.window is not None
    assert len(writer_runs) == 2
    for name in ("0", "1"):
        out = snapshard.load(tmp_path / name)
        assert out["step"] == 7
        for k, v in tree.items():
            if k != "step":
                np.testing.assert_array_equal(out[k], v)


def test_the_window_s_small_items_are_asked_for_many_runs_at_a_time(
    tmp_path, monkeypatch, writer_runs
):
    """Each request through the window wakes a thread of the training process (its recv,
    its copy, its reply: hand-overs of the interpreter a training loop pays for): a file's
    small items are read up to READ_AHEAD bytes at a time, not a run (4 MiB) at a time."""
    writer_process.stop_writer()
    monkeypatch.setattr(writer_process, "_WINDOW_ONLY", True)
    rows = []
    real = writer_exposure.Exposure.copy

    def counted(self, asked):
        rows.append(len(asked))
        return real(self, asked)

    monkeypatch.setattr(writer_exposure.Exposure, "copy", counted)
    tree = {f"a{i}": np.full((64, 64), i, np.float32) for i in range(2000)}  # 32 MiB
    try:
        snapshard.save_async(tmp_path / "x", tree, PROCESS).wait()
    finally:
        writer_process.stop_writer()
    assert sum(rows) == 2000 and len(rows) <= 3, rows  # (runs of 4 MiB: 8 requests)
    out = snapshard.load(tmp_path / "x")
    assert all(float(out[f"a{i}"][63, 63]) == i for i in range(2000))


def test_a_writer_killed_while_reading_through_the_window_leaves_nothing(
    tmp_path, monkeypatch, through_the_window
):
    real = writer_exposure.Exposure.copy
    copies = []

    def kills_on_the_second(self, rows):
        copies.append(len(rows))
        if len(copies) == 2:
            os.kill(_writer_pid(), signal.SIGKILL)
            writer_process._writer.proc.wait()  # type: ignore[union-attr]
        return real(self, rows)

    monkeypatch.setattr(writer_exposure.Exposure, "copy", kills_on_the_second)
    tree = {"a": np.arange(50_000.0), "b": np.ones((64, 64), np.float32)}
    with pytest.raises(SnapshardError, match="the writer process was killed by SIGKILL"):
        snapshard.save_async(tmp_path / "x", tree, PROCESS).wait()
    assert not (tmp_path / "x").exists() and _leftovers(tmp_path) == []
    snapshard.save_async(tmp_path / "x", tree, PROCESS).wait()  # a new writer
    np.testing.assert_array_equal(snapshard.load(tmp_path / "x")["a"], tree["a"])


def test_the_window_serves_only_the_bytes_of_the_save_s_items(tmp_path, through_the_window):
    snapshard.save_async(tmp_path / "x", {"a": np.ones(8)}, PROCESS).wait()
    assert writer_process._writer is not None
    ex = writer_process._writer.exposure
    assert ex.window is not None
    host = np.arange(8, dtype=np.uint8)
    ex.expose([], [host], np.array([host.ctypes.data]))
    ex.copy(np.array([[0, 2, 4, 10], [0, 0, 1, 14], [0, 7, 1, 20]]))
    assert ex.window[10:15].tolist() == [2, 3, 4, 5, 0] and ex.window[20] == 7
    for bad in ([0, 6, 4, 0], [0, -1, 2, 0], [0, 0, 2, len(ex.window) - 1], [1, 0, 1, 0]):
        with pytest.raises(SnapshardError, match=re.escape(f"out of range: {tuple(bad)}")):
            ex.copy(np.array([[0, 0, 1, 0], bad]))
    ex.release()


def test_a_writer_that_cannot_be_started_sends_saves_to_threads_and_keeps_no_files(
    tmp_path, monkeypatch, caplog
):
    writer_process.stop_writer()
    monkeypatch.setattr(writer_process, "_unusable", None)
    monkeypatch.setattr(writer_process, "_told", set())

    def no_process(*args, **kwargs):
        raise OSError("no processes left")

    monkeypatch.setattr(writer_process.subprocess, "Popen", no_process)
    before = len(os.listdir("/proc/self/fd"))
    with caplog.at_level(logging.WARNING, "snapshard"):
        snapshard.save_async(tmp_path / "x", {"a": np.arange(3.0)}, PROCESS).wait()
    assert len(os.listdir("/proc/self/fd")) == before  # the socket and the window closed
    assert any("could not be started: no processes left" in r.getMessage() for r in caplog.records)
    assert snapshard.load(tmp_path / "x")["a"].tolist() == [0.0, 1.0, 2.0]


@pytest.fixture
def staged_copies(monkeypatch):
    """The items the host budget left for later whose host copies the training process holds
    now (`Exposure.stage` to `unstage`), and the most it held at once: ([items], [most])."""
    held: list[int] = []
    most = [0]
    real_stage, real_unstage = writer_exposure.Exposure.stage, writer_exposure.Exposure.unstage

    def stage(self, j):
        held.append(j)
        most[0] = max(most[0], len(held))
        return real_stage(self, j)

    def unstage(self, j):
        held.remove(j)
        real_unstage(self, j)

    monkeypatch.setattr(writer_exposure.Exposure, "stage", stage)
    monkeypatch.setattr(writer_exposure.Exposure, "unstage", unstage)
    return held, most


@pytest.fixture
def copying(monkeypatch):
    """JAX's CPU arrays copied in the blocking phase (as on an accelerator), so that a host
    budget leaves copies to the background phase."""
    from snapshard.jax import arrays as jax_arrays

    monkeypatch.setattr(jax_arrays, "_cpu_donation_safe", False)


@pytest.mark.parametrize("read", ["memory", "window"])
def test_items_beyond_the_host_budget_are_copied_when_the_writer_asks(
    tmp_path, writer_runs, copying, staged_copies, request, read
):
    """A host budget smaller than the bytes owned: the save still runs in the writer, which
    asks for each remaining item's host copy as it writes it and lets it go after: one at
    a time with one writer reading memory, a window's worth at most through the window."""
    from conftest import mesh, sharded

    if read == "window":
        request.getfixturevalue("through_the_window")
    m = mesh(2, 4)
    values = {f"w{i}": np.arange(64 * 64, dtype=np.float32).reshape(64, 64) + i for i in range(4)}
    tree = {k: sharded(v, m, None, "model") for k, v in values.items()}
    budget = 2 * 64 * 64 * 4
    opts = SaveOptions(background="process", host_budget=budget, writers=1)
    t = snapshard.save_async(tmp_path / "c", tree, opts).wait(60)
    held, most = staged_copies
    assert len(writer_runs) == 1
    assert 0 < t.bytes_staged <= budget
    assert held == []  # every copy let go
    item = 64 * 16 * 4  # a quarter of an array: its column band on one device
    assert most[0] == 1 if read == "memory" else 1 <= most[0] <= (1 << 16) // item
    out = snapshard.load(tmp_path / "c")
    for k, v in values.items():
        np.testing.assert_array_equal(out[k], v)


def test_items_left_for_later_by_the_host_budget_are_not_read_ahead(
    tmp_path, monkeypatch, copying, staged_copies
):
    """Through the window the training process makes the host copies of the items the host
    budget left for later when a request asks for them, and holds them until they are
    copied: those are asked for a run (4 MiB) at a time, not READ_AHEAD's 16 MiB."""
    writer_process.stop_writer()
    monkeypatch.setattr(writer_process, "_WINDOW_ONLY", True)
    from conftest import mesh, sharded

    m = mesh(1, 1)
    tree = {f"a{i}": sharded(np.full((64, 64), i, np.float32), m) for i in range(1500)}
    opts = SaveOptions(background="process", host_budget=1 << 20, writers=1)
    try:
        snapshard.save_async(tmp_path / "x", tree, opts).wait(120)
    finally:
        writer_process.stop_writer()
    held, most = staged_copies
    assert held == [] and 0 < most[0] <= (4 << 20) // (64 * 64 * 4), most[0]
    out = snapshard.load(tmp_path / "x")
    assert all(float(out[f"a{i}"][5, 5]) == i for i in range(1500))


@pytest.mark.parametrize("read", ["memory", "window"])
def test_an_array_deleted_before_the_writer_asks_for_its_copy_fails_naming_it(
    tmp_path, writer_runs, copying, monkeypatch, request, read
):
    """The caller deleted an array whose copy the host budget left to the background phase
    (SaveOptions.host_budget says not to): the save fails with an error naming the leaf,
    nothing is committed, and the next save works."""
    import threading

    from conftest import mesh, sharded

    if read == "window":
        request.getfixturevalue("through_the_window")
    gate = threading.Event()
    real_stage = writer_exposure.Exposure.stage

    def stage(self, j):  # answered in this process: held until the arrays are gone
        gate.wait(30)
        return real_stage(self, j)

    monkeypatch.setattr(writer_exposure.Exposure, "stage", stage)
    m = mesh(2, 4)
    a = sharded(np.ones((64, 64), np.float32), m, None, "model")
    b = sharded(np.ones((64, 64), np.float32), m, None, "model")
    opts = SaveOptions(background="process", host_budget=64 * 64 * 4, writers=1)
    handle = snapshard.save_async(tmp_path / "c", {"a": a, "b": b}, opts)
    a.delete()
    b.delete()
    gate.set()
    with pytest.raises(SnapshardError, match=r"leaf '[ab]'.*deleted"):
        handle.wait(60)
    assert len(writer_runs) == 1
    assert not (tmp_path / "c").exists()
    c = sharded(np.full((64, 64), 3, np.float32), m, None, "model")
    snapshard.save_async(tmp_path / "d", {"c": c}, opts).wait(60)
    assert np.all(snapshard.load(tmp_path / "d")["c"] == 3)


def test_a_run_of_items_is_read_in_one_call_and_a_bad_address_is_read_alone(tmp_path):
    # The writer reads a run of staged items with one process_vm_readv (into one buffer,
    # each at a multiple of 64 bytes); what that call leaves unread, from the first item it
    # could not read on, is read item by item, and the item that cannot be read fails
    # alone, naming the failure. (Read here from this very process.)
    from snapshard.saving.writer_reads import RemoteBytes

    pid = os.getpid()
    arrays = [np.arange(n, dtype=dt) for n, dt in ((5, np.float32), (7, np.int8), (0, np.int64))]
    arrays.append(np.full((3, 2), 7.5, np.float64))
    parts = [RemoteBytes(pid, a.ctypes.data, a.dtype, a.shape) for a in arrays]
    bad = RemoteBytes(pid, 8, np.dtype(np.float32), (4,))  # the first page: never mapped
    RemoteBytes.read_together([*parts[:2], bad, *parts[2:]])
    assert parts[0].got is not None and parts[1].got is not None
    assert bad.got is None and parts[2].got is None and parts[3].got is None
    for p, a in zip(parts, arrays, strict=True):
        got = np.asarray(p)
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a)
        assert got.ctypes.data % 16 == 0
    with pytest.raises(SnapshardError, match="could not read a staged item"):
        np.asarray(bad)
