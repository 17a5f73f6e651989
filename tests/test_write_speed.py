"""The save's writer: early writeback, the data-file count chosen from measured throughput,
and restored replicas sharing one host buffer on CPU devices."""

import itertools
import os

import jax
import numpy as np
import pytest

import snapshard
from snapshard import SaveOptions
from snapshard.jax.arrays import cpu_donation_keeps_memory
from snapshard.saving import write_tuning
from snapshard.saving.write_tuning import WriterCounts
from snapshard.storage import writeback

from conftest import mesh, sharded


def test_writeback_keeps_bytes_and_requests_windows(tmp_path, monkeypatch):
    monkeypatch.setattr(writeback, "WINDOW", 1 << 16)
    calls = []
    real = writeback._SYNC_FILE_RANGE
    if real is None:
        pytest.skip("no sync_file_range here")

    def spy(fd, offset, nbytes, flags):
        calls.append((offset, nbytes, flags))
        return real(fd, offset, nbytes, flags)

    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", spy)
    path = tmp_path / "f"
    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    wb = writeback.Writeback(fd)
    size = 0
    for piece in np.split(data, 32):
        size += os.write(fd, piece.tobytes())
        wb.written(size)
    os.fsync(fd)
    os.close(fd)
    assert path.read_bytes() == data.tobytes()
    started = [(o, n) for o, n, f in calls if f == 2]
    waited = [(o, n) for o, n, f in calls if f == 7]
    # every byte but the last partial window was handed to the disk, once, in order
    assert started[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(started))
    assert sum(n for _, n in started) == wb.requested
    assert wb.requested > len(data) - writeback.WINDOW
    # and the writer waited only for bytes at least one window behind what it asked for
    assert waited and all(o + n <= wb.requested - writeback.WINDOW for o, n in waited)


def test_writeback_turns_itself_off_where_unsupported(tmp_path):
    r, w = os.pipe()  # sync_file_range refuses pipes (ESPIPE)
    try:
        wb = writeback.Writeback(w)
        wb.requested = 0
        os.write(w, b"x")
        wb.written(writeback.WINDOW)
        assert not wb.enabled
    finally:
        os.close(r)
        os.close(w)


def test_writer_counts_start_with_the_default_then_keep_the_fastest():
    t = WriterCounts((1, 2))
    big = 1 << 30
    assert t.choose(1000) == write_tuning.DEFAULT_COUNT  # too small to learn from
    for _ in range(write_tuning.FIRST_SAVES):
        assert t.choose(big) == 2
        t.record(2, big, 0.5)
    assert t.choose(big) == 1  # then the other candidate, once
    t.record(1, big, 1.0)  # 2 files were twice as fast
    picks = [t.choose(big) for _ in range(2 * write_tuning.EXPLORE_EVERY)]
    assert picks.count(2) >= len(picks) - 2 and 1 in picks  # mostly 2, re-checks 1 now and then
    t.record(1, 100, 0.0)  # small or empty measurements change nothing
    assert t.history[1] == [big / 1.0]
    for _ in range(3):  # the disk changed: 1 file is now faster, and stays chosen
        t.record(1, big, 0.1)
    assert t.choose(big) == 1


def test_save_chooses_and_reports_its_file_count(tmp_path, monkeypatch):
    monkeypatch.setattr(write_tuning, "MIN_BYTES", 1 << 16)
    monkeypatch.setattr(write_tuning, "_by_location", {})
    m = mesh(2, 4)
    x = np.arange(1 << 18, dtype=np.float32).reshape(512, 512)
    tree = {"a": sharded(x, m, None, "model"), "b": sharded(x + 1, m, "model", None)}
    counts = []
    for step in range(write_tuning.FIRST_SAVES + 2):
        t = snapshard.save(tmp_path / str(step), tree)
        counts.append(t.data_files)
        files = os.listdir(tmp_path / str(step) / "data")
        assert len(files) == t.data_files
        out = snapshard.load(tmp_path / str(step))
        np.testing.assert_array_equal(out["b"], x + 1)
    first = write_tuning.FIRST_SAVES
    assert counts[:first] == [2] * first and counts[first] == 1  # the default, then the other
    tuner = write_tuning.counts_for(str(tmp_path / "0"), False)
    assert set(tuner.history) == {1, 2}
    assert snapshard.save(tmp_path / "fixed", tree, options=SaveOptions(writers=3)).data_files == 3
    with pytest.raises(ValueError, match="writers"):
        snapshard.save(tmp_path / "bad", tree, options=SaveOptions(writers=0))


def test_replicas_on_cpu_devices_share_one_buffer_and_survive_donation(tmp_path):
    assert cpu_donation_keeps_memory()
    m = mesh(2, 4)
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    snapshard.save(tmp_path / "c", {"w": sharded(x, m, None, "model")})
    target = {
        "w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded(x, m, None, "model").sharding)
    }
    w = snapshard.load(tmp_path / "c", target)["w"]
    by_index: dict[str, list] = {}
    index_of: dict[str, tuple] = {}
    for s in w.addressable_shards:
        by_index.setdefault(str(s.index), []).append(s.data)
        index_of[str(s.index)] = s.index
    for copies in by_index.values():
        assert len(copies) == 2  # the data axis replicates each box twice
        assert len({c.unsafe_buffer_pointer() for c in copies}) == 1
    key = next(iter(by_index))
    shard = by_index[key]
    donated = jax.jit(lambda a: a * 0 - 1, donate_argnums=0)(shard[1])
    assert np.all(np.asarray(donated) == -1)
    np.testing.assert_array_equal(
        np.asarray(shard[0]), x[index_of[key]]
    )  # the other copy kept its bytes
    np.testing.assert_array_equal(np.asarray(w), x)


def test_a_failing_writeback_is_a_storage_error_naming_the_file(tmp_path, monkeypatch):
    import ctypes
    import errno

    from snapshard.errors import StorageError
    from snapshard.storage.local_files import LocalFileWriter

    def failing(fd, offset, nbytes, flags):
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(writeback, "WINDOW", 1 << 12)
    monkeypatch.setattr(writeback, "_SYNC_FILE_RANGE", failing)
    w = LocalFileWriter(tmp_path / "data.bin")
    w.writeback.enabled = True
    with pytest.raises(StorageError, match=r"data\.bin"):
        w.write(memoryview(bytes(1 << 13)))
    w.abort()
