"""Verified local reads: cache-sized pieces when the bytes are in the page cache, large
pieces when they must come from the device (`Storage.in_memory`)."""

from __future__ import annotations

import errno
import os
import threading
import time

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
from snapshard import cpus
from snapshard.errors import ChecksumMismatchError
from snapshard.format import checksum_block
from snapshard.format.reading import read_checkpoint
from snapshard.reading import Dest, ReadStats, aligned_empty, prefetch, reader_of, reads, windows
from snapshard.reading import ranges as range_reads
from snapshard.storage.local import LocalStorage

from conftest import mesh


@pytest.fixture
def saved(tmp_path):
    x = (np.arange(10 << 20, dtype=np.float32) % 1009).reshape(2560, 4096)  # 40 MiB, one chunk
    snapshard.save(tmp_path / "c", {"x": x})
    return tmp_path / "c", x


def _piece_sizes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = LocalStorage.read_into

    def spy(self, name, offset, buffers):
        if name.startswith("data/"):
            sizes.append(sum(len(b) for b in buffers))
        return real(self, name, offset, buffers)

    monkeypatch.setattr(LocalStorage, "read_into", spy)
    return sizes


@pytest.mark.parametrize("cached", [True, False, None])
def test_the_piece_size_follows_the_page_cache(saved, monkeypatch, cached):
    path, x = saved
    monkeypatch.setattr(LocalStorage, "in_memory", lambda self, name, offset: cached)
    sizes = _piece_sizes(monkeypatch)
    out = snapshard.load(path)
    assert np.array_equal(out["x"], x)
    data = [s for s in sizes if s > 4096]  # the checksums come in a read of their own
    # None: the storage cannot tell (tmpfs, some network filesystems): cache-sized pieces.
    piece = LocalStorage.cold_read_piece_bytes if cached is False else LocalStorage.read_piece_bytes
    assert piece is not None
    block = checksum_block(x.nbytes)  # pieces are whole checksum blocks
    assert max(data) == max(block, piece // block * block) and sum(data) == x.nbytes


def test_damage_is_found_in_large_pieces_too(saved, monkeypatch):
    path, _ = saved
    monkeypatch.setattr(LocalStorage, "in_memory", lambda self, name, offset: False)
    f = next((path / "data").iterdir())
    raw = bytearray(f.read_bytes())
    raw[30 << 20] ^= 0x10  # inside the second large piece
    f.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match="leaf 'x'"):
        snapshard.load(path)


def test_in_memory_tells_cached_bytes(saved):
    path, x = saved
    f = next((path / "data").iterdir())
    name = "data/" + f.name
    fd = os.open(f, os.O_RDONLY)
    try:  # some filesystems (tmpfs) cannot tell: in_memory then says None, as documented
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            pytest.skip(f"{path}: this filesystem does not support RWF_NOWAIT reads")
    finally:
        os.close(fd)
    storage = LocalStorage(path)
    try:
        np.asarray(snapshard.load(storage)["x"])  # read: in the page cache now
        assert storage.in_memory(name, 0)
        assert storage.in_memory(name, x.nbytes - 1)
        assert not storage.in_memory(name, 1 << 40)  # past the end: nothing to read
    finally:
        storage.close()


# ---- column-split reads: copied out of a small scratch window, row by row


def _windowed_calls(monkeypatch) -> list[int]:
    """The window of every windowed read (spied); windows as small as the pieces."""
    monkeypatch.setattr(windows, "_WINDOW_BYTES", 1)
    calls: list[int] = []
    real = reads.read_windowed

    def spy(storage, task, grids, dests, window, checked):
        calls.append(window)
        return real(storage, task, grids, dests, window, checked)

    monkeypatch.setattr(reads, "read_windowed", spy)
    return calls


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.integers(70, 400),
    cols=st.integers(8, 300),
    depth=st.sampled_from([1, 3, 8]),
    data=st.data(),
    piece=st.sampled_from([1024, 4096, 5000, 65536]),
    verify=st.booleans(),
    scatter_limit=st.sampled_from([0, 64]),
)
def test_column_split_reads_through_a_window_are_exact(
    tmp_path_factory, monkeypatch, rows, cols, depth, data, piece, verify, scatter_limit
):
    """Boxes of some columns (with the columns between them not needed) and some rows,
    several of them interleaved in one chunk, 2-D and 3-D, rows cut by a window's end and
    rows larger than a window, overlaps whole in a range or split across ranges: each box
    bit-exact, whichever way it was read."""
    path = tmp_path_factory.mktemp("w") / "c"
    shape = (rows, cols, depth) if depth > 1 else (rows, cols)
    x = np.random.default_rng(rows * cols).standard_normal(shape).astype(np.float32)
    snapshard.save(path, {"x": x})  # one chunk
    # Disjoint column blocks, each over its own rows.
    edges = sorted(data.draw(st.sets(st.integers(1, cols - 1), min_size=1, max_size=6)))
    blocks = list(zip([0, *edges], [*edges, cols], strict=True))
    chosen = data.draw(st.lists(st.sampled_from(blocks), min_size=1, unique=True))
    boxes = []
    for c0, c1 in chosen:
        r0 = data.draw(st.integers(0, rows - 65))
        r1 = data.draw(st.integers(r0 + 65, rows))  # enough runs for the scratch path
        boxes.append(((r0, c0), (r1, c1)))
    monkeypatch.setattr(LocalStorage, "read_piece_bytes", piece)
    monkeypatch.setattr(windows, "_WINDOW_BYTES", 1)  # windows as small as the pieces
    # 0: every range through scratch (windowed where its overlaps lie whole in it).
    monkeypatch.setattr(reads, "_MAX_SCATTER_PIECES", scatter_limit)
    with LocalStorage(path) as storage:
        manifest, finder = read_checkpoint(storage)
        leaf = manifest.arrays[0]
        dests = []
        for lo, hi in boxes:
            start = np.array([*lo, 0][: len(shape)], np.int64)
            stop = np.array([*hi, depth][: len(shape)], np.int64)
            nbytes = int(np.prod(stop - start)) * 4
            dests.append(Dest(leaf, start, stop, aligned_empty(nbytes)))
        stats = ReadStats()
        reader_of(storage, manifest, finder, snapshard.ReadOptions(verify=verify), stats)(dests)
    for d, (lo, hi) in zip(dests, boxes, strict=True):
        want = x[lo[0] : hi[0], lo[1] : hi[1]]
        assert np.array_equal(d.buf.view(np.float32).reshape(want.shape), want)


@pytest.mark.parametrize("verify", [True, False])
def test_a_window_is_whole_checksum_blocks_and_at_least_a_row(tmp_path, monkeypatch, verify):
    """Rows longer than a piece widen the window, so that a carried row never exceeds it;
    windows are whole checksum blocks, so rows are copied out of checked bytes only."""
    x = np.random.default_rng(3).standard_normal((64, 8, 4096)).astype(np.float32)
    snapshard.save(tmp_path / "c", {"x": x})
    block = checksum_block(x.nbytes)
    row = 7 * 4096 * 4 + 4096 * 4 // 8  # one device's part of a row: 7 strides and a run
    assert block < row
    monkeypatch.setattr(LocalStorage, "read_piece_bytes", 1)
    calls = _windowed_calls(monkeypatch)
    m = mesh(1, 8)
    spec = P(None, None, "model")
    target = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, spec))
    out = snapshard.load(tmp_path / "c", {"x": target}, snapshard.ReadOptions(verify=verify))
    assert np.array_equal(np.asarray(out["x"]), x)
    assert calls == [-(-row // block) * block]


def test_a_window_never_outgrows_the_scratch_limit(tmp_path, monkeypatch):
    """Rows so long that window and carry would pass the scratch reuse limit: the range is
    read whole into scratch, as before windows."""
    x = np.random.default_rng(4).standard_normal((4, 64, 256)).astype(np.float32)
    snapshard.save(tmp_path / "c", {"x": x})
    monkeypatch.setattr(LocalStorage, "read_piece_bytes", 1)
    monkeypatch.setattr(range_reads, "_SCRATCH_REUSE_BYTES", 64 * 256 * 4)  # about a row
    calls = _windowed_calls(monkeypatch)
    copies: list[int] = []
    real = reads.copy_from_scratch
    monkeypatch.setattr(reads, "copy_from_scratch", lambda *a: copies.append(1) or real(*a))
    m = mesh(1, 8)
    target = jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(m, P(None, None, "model"))
    )
    out = snapshard.load(tmp_path / "c", {"x": target})
    assert np.array_equal(np.asarray(out["x"]), x)
    assert calls == [] and copies


def test_damage_is_found_by_a_windowed_read(saved, monkeypatch):
    """A damaged byte in the columns a column-split read does not need still fails it."""
    path, x = saved
    calls = _windowed_calls(monkeypatch)
    f = next((path / "data").iterdir())
    raw = bytearray(f.read_bytes())
    raw[(1000 * 4096 + 4000) * 4] ^= 0x10  # row 1000, column 4000
    f.write_bytes(bytes(raw))
    m = mesh(1, 8)
    target = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P(None, "model")))
    with pytest.raises(ChecksumMismatchError, match="leaf 'x'"):
        snapshard.load(path, {"x": target})
    assert calls


# ---- read threads left to the storage (ReadOptions.threads=None)


def _pool_sizes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = reads.ThreadPoolExecutor

    def spy(max_workers, **kw):
        sizes.append(max_workers)
        return real(max_workers, **kw)

    monkeypatch.setattr(reads, "ThreadPoolExecutor", spy)
    return sizes


def _many_chunks(tmp_path):
    x = np.arange(64 << 10, dtype=np.float32).reshape(64, 1024)
    m = mesh(8)
    snapshard.save(tmp_path / "c", {"x": jax.device_put(x, NamedSharding(m, P("data")))})
    return tmp_path / "c", x  # 8 chunks: 8 reads


@pytest.mark.parametrize("cached", [True, False, None])
@pytest.mark.parametrize("processes", [1, 2])
def test_read_threads_follow_the_page_cache_and_the_cpu_share(
    tmp_path, monkeypatch, cached, processes
):
    path, x = _many_chunks(tmp_path)
    monkeypatch.setattr(cpus, "usable", lambda: 2)
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    monkeypatch.setattr(LocalStorage, "in_memory", lambda self, name, offset: cached)
    sizes = _pool_sizes(monkeypatch)
    out = snapshard.load(path)
    assert np.array_equal(out["x"], x)
    share = 2 // processes
    if cached is True and share == 1:
        assert sizes == []  # one thread: the calling one
    else:
        # Bytes from the device, or a storage that cannot tell: the device's threads.
        assert sizes == [share if cached is True else LocalStorage.read_threads]


def test_read_threads_set_by_the_caller_are_kept(tmp_path, monkeypatch):
    path, x = _many_chunks(tmp_path)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    sizes = _pool_sizes(monkeypatch)
    assert np.array_equal(snapshard.load(path, options=snapshard.ReadOptions(threads=3))["x"], x)
    assert sizes == [3]


@pytest.mark.parametrize("cached", [False, True, None])
def test_reads_from_the_device_are_asked_for_ahead(tmp_path, monkeypatch, cached):
    """Bytes on the device: while a read waits, the ranges of the reads after it are hinted
    to the storage (`will_need`), each once, in the order they are read. Bytes in memory,
    or a storage that cannot tell: no hints."""
    hints, data, _ = _hinted_reads(tmp_path, monkeypatch, cached, wait_for=7)
    if cached is not False:
        assert hints == []
        return
    # every read after the first (and the first too when its hint came before it began)
    assert len(data) == 8 and len(hints) in (7, 8)
    assert [(n, o) for n, o, _ in hints] == data[8 - len(hints) :]
    assert all(n == (64 << 10) * 4 // 8 for _, _, n in hints)


def test_hints_stay_within_the_window_ahead_of_the_reads(tmp_path, monkeypatch):
    """A window of 2 reads' bytes: while the first read waits, only the reads whose start
    lies within 2 reads of the next one are hinted (3, and the first's own when it came
    first); later hints follow the reads, in order, none twice."""
    monkeypatch.setattr(prefetch, "_PREFETCH_BYTES", 2 * (64 << 10) * 4 // 8)
    hints, data, early = _hinted_reads(tmp_path, monkeypatch, False, wait_for=3, more=0.3)
    assert early in (3, 4), early
    hinted = [(n, o) for n, o, _ in hints]
    assert len(set(hinted)) == len(hinted)
    assert hinted == [r for r in data if r in hinted]  # in the order of the reads


def _hinted_reads(tmp_path, monkeypatch, cached, wait_for: int, more: float = 0.0):
    """Load a checkpoint of 8 equal reads, one thread, the page-cache probe answering
    `cached`; the first read waits until `wait_for` hints came (or 2 s), then `more` s.
    Returns the hints, the reads of data files in order, and the hints given before the
    first read went on."""
    path, x = _many_chunks(tmp_path)
    monkeypatch.setattr(LocalStorage, "in_memory", lambda self, name, offset: cached)
    hints: list[tuple[str, int, int]] = []
    reads: list[tuple[str, int]] = []
    enough = threading.Event()
    early: list[int] = []

    def hint(self, *a):
        hints.append(a)
        if len(hints) >= wait_for:
            enough.set()

    monkeypatch.setattr(LocalStorage, "will_need", hint)
    real = LocalStorage.read_into

    def read(self, name, offset, buffers):
        if name.startswith("data/") and not reads:
            enough.wait(2.0)
            time.sleep(more)
            early.append(len(hints))
        if name.startswith("data/"):
            reads.append((name, offset))
        real(self, name, offset, buffers)

    monkeypatch.setattr(LocalStorage, "read_into", read)
    out = snapshard.load(path, options=snapshard.ReadOptions(threads=1))
    assert np.array_equal(out["x"], x)
    assert not any(t.name == "snapshard-prefetch" for t in threading.enumerate())
    return hints, reads, early[0] if early else None


def test_local_processes_come_from_the_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpus.local_processes() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert cpus.local_processes() == 8
    monkeypatch.setattr(cpus, "usable", lambda: 4)
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 4)
    assert cpus.share() == 1  # never 0
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 64)
    assert cpus.share() == 4  # pinned to 4 of 64 cores by the launcher: divided already
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert cpus.local_processes() == 1
