"""The save's bulk paths against the chunk-by-chunk definitions they replace: the same data
file bytes and records (chunk_files), the same record segments (format.records), the same
items per process (planning.write_plan) and the same leaf descriptions (saving)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from snapshard.format import records
from snapshard.format.binding import name_key
from snapshard.format.encoding import ZSTD, chunk_span, write_chunk
from snapshard.planning import plan_writes
from snapshard.saving import chunk_files, path_json
from snapshard.saving.staging import StagedItem
from snapshard.storage import storage_for
from test_write_plan import layouts


def _items(rng: np.random.Generator) -> list[StagedItem]:
    """Host items of many sizes and kinds: small and multi-block chunks, 0-d arrays, NumPy
    scalars, non-contiguous views, dtypes a memoryview cannot describe."""
    out = []
    for i in range(300):
        kind = i % 7
        if kind == 0:
            host: object = rng.standard_normal((8, 16)).astype(np.float32)
        elif kind == 1:
            host = rng.standard_normal((300, 40)).astype(np.float32)  # 48000 bytes: many blocks
        elif kind == 2:
            host = np.asarray(rng.standard_normal(), np.float64)  # 0-d
        elif kind == 3:
            host = np.float32(rng.standard_normal())  # a NumPy scalar
        elif kind == 4:
            host = rng.standard_normal((10, 12)).astype(np.float32)[:, ::3]  # not contiguous
        elif kind == 5:
            host = rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16)
        else:
            host = rng.integers(0, 9, int(rng.integers(1, 5000))).astype(np.int8)
        arr = np.asarray(host)
        start = np.zeros(arr.ndim, np.int64)
        stop = np.asarray(arr.shape, np.int64)
        out.append(StagedItem(i, f"leaf{i}", start, stop, arr.nbytes, host=host))  # type: ignore[arg-type]
    return out


def _one_by_one(path, name, items, codec_of):
    """The definition: every chunk through write_chunk, in order."""
    key = name_key(name)
    data, rows, offset = bytearray(), [], 0

    class Sink:
        def write(self, b):
            data.extend(b)

    for it in items:
        codec = codec_of(it) if codec_of is not None else 0
        row = write_chunk(Sink(), np.asarray(it.host), it.start, it.stop, 0, offset,
                          file_key=key, codec=codec)  # fmt: skip
        rows.append((it.leaf, row))
        offset = row.end()
    return bytes(data), rows


@pytest.mark.parametrize("compressed", [False, True])
def test_a_data_file_written_in_bulk_holds_the_bytes_and_records_of_chunk_by_chunk(
    tmp_path, compressed
):
    from snapshard.format import compression

    if compressed and not compression.available():
        pytest.skip("zstd is not installed")
    rng = np.random.default_rng(7)
    # Compressed: every other leaf, so that runs of plain small chunks are cut by others.
    codec_of = (lambda it: ZSTD if it.leaf % 2 else 0) if compressed else None
    want_bytes, want_rows = _one_by_one(
        tmp_path, "data/p00000-abcd0123-0.bin", _items(rng), codec_of
    )
    storage = storage_for(tmp_path / "ckpt")
    storage.prepare_staging()
    rng = np.random.default_rng(7)
    got = chunk_files.write_file(storage, "data/p00000-abcd0123-0.bin", _items(rng), codec_of)
    raw = storage.read_staging("data/p00000-abcd0123-0.bin")
    assert raw == want_bytes and got.size == len(want_bytes)
    records = [
        (it.leaf, (*f, [int(x) for x in it.start], [int(x) for x in it.stop]))
        for it, f in zip(got.items, got.fixed.tolist(), strict=True)
    ]
    assert records == [(leaf, tuple(r)) for leaf, r in want_rows]
    assert all(it.host is None for it in got.items)  # released once written


@pytest.mark.parametrize("short", [False, True])
def test_a_long_run_of_small_chunks_is_written_as_it_is(tmp_path, monkeypatch, short):
    """A run of small chunks longer than a coalesced write goes to a local file as its
    parts (writev, no copy joined); `short`: every writev writes only part of what it is
    given (as a system call may), and the rest still lands in order."""
    import os

    from snapshard.storage import local_files

    calls = []
    real = os.writev

    def writev(fd, bufs):
        calls.append(len(bufs))
        if not short:
            return real(fd, bufs)
        half = bufs[: max(1, len(bufs) // 2)]  # the first half of the parts, and 3 bytes more
        n = real(fd, half)
        rest = bufs[len(half)] if len(bufs) > len(half) else b""
        return n + os.write(fd, memoryview(rest)[:3]) if len(rest) >= 3 else n

    monkeypatch.setattr(local_files.os, "writev", writev)
    rng = np.random.default_rng(3)
    blocks = rng.standard_normal((1500, 16, 16)).astype(np.float32)  # 1 KiB each: 1.5 MiB

    def items():
        return [
            StagedItem(i, f"l{i}", np.zeros(2, np.int64), np.asarray([16, 16]), 1024, host=b)
            for i, b in enumerate(blocks)
        ]

    name = "data/p00000-abcd0123-0.bin"
    want, _ = _one_by_one(tmp_path, name, items(), None)
    storage = storage_for(tmp_path / "ckpt")
    storage.prepare_staging()
    got = chunk_files.write_file(storage, name, items())
    assert storage.read_staging(name) == want and got.size == len(want)
    assert calls and max(calls) <= local_files._IOV_MAX


def test_items_go_to_the_lightest_file_largest_first():
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 50, 400).tolist() + [7] * 100
    items = [StagedItem(i, "x", np.zeros(0), np.zeros(0), n) for i, n in enumerate(sizes)]
    for n in (1, 2, 3, 8):
        want: list[list[int]] = [[] for _ in range(n)]
        load = [0] * n
        for it in sorted(items, key=lambda it: -it.nbytes):
            j = load.index(min(load))
            want[j].append(it.leaf)
            load[j] += it.nbytes
        got = chunk_files.split_files(items, n)
        assert [[it.leaf for it in f] for f in got] == [w for w in want if w]
    assert chunk_files.split_files([], 4) == []


def _spans(files):
    return [sum(chunk_span(it.nbytes) for it in f) for f in files]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 12 << 20), min_size=1, max_size=80),
    st.integers(1, 4),
    st.sampled_from([2 << 20, 8 << 20, 32 << 20]),
)
@example([11183815] * 5, 2, 32 << 20)  # fits 2 files by its bytes, not split evenly
def test_object_store_files_are_cut_to_fit_one_request(sizes, writers, most):
    """Every item in exactly one file; at least `writers` files (as the items allow), at
    most MAX_CUT_FILES; each within `most` bytes unless it holds an item larger than that,
    or the cap was reached."""
    items = [StagedItem(i, "x", np.zeros(0), np.zeros(0), n) for i, n in enumerate(sizes)]
    files = chunk_files.cut_files(items, writers, most)
    assert sorted(it.leaf for f in files for it in f) == list(range(len(items)))
    assert min(writers, len(items)) <= len(files) <= max(writers, chunk_files.MAX_CUT_FILES)
    if len(files) < chunk_files.MAX_CUT_FILES:
        for f, span in zip(files, _spans(files), strict=True):
            assert span <= most or len(f) == 1 or max(chunk_span(it.nbytes) for it in f) > most


def test_the_peer_bench_state_is_cut_into_files_of_one_request():
    """600 MiB in 48 boxes of 10 MiB, 24 of 5 MiB and 6 of 20 KiB: 20 files of 30 MiB, not
    2 of 300 MiB; without a limit (local files) as many as writers."""
    sizes = [10 << 20] * 48 + [5 << 20] * 24 + [20 << 10] * 6
    items = [StagedItem(i, "x", np.zeros(0), np.zeros(0), n) for i, n in enumerate(sizes)]
    files = chunk_files.cut_files(items, 2, 32 << 20)
    assert len(files) == 20 and max(_spans(files)) <= 32 << 20
    assert len(chunk_files.cut_files(items, 2, None)) == 2
    assert len(chunk_files.cut_files(items, 2, 1 << 20)) == chunk_files.MAX_CUT_FILES


def test_files_at_once_hold_each_writers_upload_bytes_at_the_largest_file():
    def groups(*mib):
        return [[StagedItem(0, "x", np.zeros(0), np.zeros(0), m << 20)] for m in mib]

    per_writer = 144 << 20  # 16 MiB parts, 8 in flight and one being filled
    assert chunk_files.files_at_once(groups(*[30] * 20), 2, per_writer) == 8
    assert chunk_files.files_at_once(groups(*[30] * 19, 64), 2, per_writer) == 4
    assert chunk_files.files_at_once(groups(*[30] * 5, 1024), 2, per_writer) == 2  # parts
    assert chunk_files.files_at_once(groups(1, 1, 1), 2, per_writer) == 3
    assert chunk_files.files_at_once(groups(*[30] * 20), 2, None) == 20  # local: all


def _random_rows(rng):
    ndims = rng.integers(0, 4, int(rng.integers(1, 30))).tolist()
    rows, seen0 = [], set()
    for _ in range(int(rng.integers(0, 120))):
        leaf = int(rng.integers(0, len(ndims)))
        d = ndims[leaf]
        if d == 0 and leaf in seen0:
            continue
        seen0.add(leaf)
        start = rng.integers(0, 4, d)
        fixed = tuple(int(x) for x in rng.integers(0, 1 << 30, 7))
        rows.append((leaf, records.ChunkRecord(*fixed, start.tolist(), (start + 1).tolist())))
    return ndims, rows


@pytest.mark.parametrize("seed", range(20))
def test_record_segments_built_for_all_leaves_at_once_are_those_of_each_leaf(seed):
    rng = np.random.default_rng(seed)
    ndims, rows = _random_rows(rng)
    by_leaf: dict[int, list] = {}
    for leaf, row in rows:
        by_leaf.setdefault(leaf, []).append(row)
    want = {leaf: records.records_of(rs, ndims[leaf]) for leaf, rs in by_leaf.items()}
    fixed = np.zeros(len(rows), records.RECORD_FIXED)
    for i, (_, row) in enumerate(rows):
        fixed[i] = tuple(row)[:7]
    # Boxes as a plan gives them (int64 arrays) for some chunks, as lists for others.
    starts = [np.asarray(r.start, np.int64) if i % 2 else r.start for i, (_, r) in enumerate(rows)]
    stops = [np.asarray(r.stop, np.int64) for _, r in rows]
    leaf = np.asarray([x for x, _ in rows], np.int64)
    got = records.sorted_segments(leaf, fixed, starts, stops, ndims)
    assert got.keys() == want.keys()
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)
    digests = np.zeros(len(ndims), records.DIGEST)
    encoded = records.encode(1, ndims, got, digests, salt=5)
    assert encoded == records.encode(1, ndims, want, digests, salt=5)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from(["single_replica", "replica_parallel", "balanced", "auto"]))
def test_a_process_s_items_found_in_bulk_are_those_of_each_array(lays, mode):
    lays = lays + lays[:1]  # two arrays of one layout: matched together
    num = max(int(la.process_ids.max()) for la in lays) + 1
    plan = plan_writes(lays, mode, num_processes=num, min_band_bytes=16)
    for q in range(num):
        want = [
            (a, k, int(p.nbytes[k]), int(p.source_row[k]))
            for a, p in enumerate(plan.arrays)
            for k in p.items_of(q).tolist()
            if p.nbytes[k]
        ]
        t = plan.process_items(q)
        got = list(zip(t.array.tolist(), t.item.tolist(), t.nbytes.tolist(),
                       t.source_row.tolist(), strict=True))  # fmt: skip
        assert got == want


@pytest.mark.parametrize("path", [(), ("a",), ("layers", 3, "w"), ('ü"q\\', 0), ("x\n", -1, "")])
def test_a_path_is_described_as_json_dumps_would(path):
    assert path_json(path) == json.dumps(list(path))
