"""Property tests of the read planner: chunk index, byte runs and coalescing against NumPy."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshard.planning import ChunkIndex, coalesce_runs, overlaps


@st.composite
def boxes_in(draw, shape):
    s, e = [], []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        s.append(a)
        e.append(b)
    return np.array(s, np.int64), np.array(e, np.int64)


@st.composite
def case(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=4)))
    chunk = draw(boxes_in(shape))
    target = draw(boxes_in(shape))
    return shape, chunk, target


@settings(max_examples=400, deadline=None)
@given(case(), st.sampled_from([1, 2, 4]))
def test_overlap_runs_copy_exactly_the_overlap(c, itemsize):
    shape, (cs, ce), (ts, te) = c
    os_, oe = np.maximum(cs, ts), np.minimum(ce, te)
    if np.any(oe <= os_):
        return
    full = (
        np.arange(int(np.prod(shape)) * itemsize, dtype=np.uint8).reshape(*shape, itemsize)
        if shape
        else np.arange(itemsize, dtype=np.uint8)
    )
    sl = lambda s, e: tuple(slice(int(a), int(b)) for a, b in zip(s, e, strict=True))  # noqa: E731
    chunk_bytes = np.ascontiguousarray(full[sl(cs, ce)]).reshape(-1)
    target = np.zeros(int(np.prod(te - ts)) * itemsize, np.uint8)
    g = overlaps.run_grid(cs, ce, ts, te, os_, oe, itemsize)
    (src, dst), run = g.runs(), g.run_bytes
    for a, b in zip(src, dst, strict=True):
        target[b : b + run] = chunk_bytes[a : a + run]
    want = np.zeros((*tuple(te - ts), itemsize), np.uint8)
    want[sl(os_ - ts, oe - ts)] = full[sl(os_, oe)]
    assert np.array_equal(target, want.reshape(-1))
    assert len(src) * run == int(np.prod(oe - os_)) * itemsize


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.data())
def test_chunk_index_finds_exactly_the_overlapping_chunks(n0, n1, data):
    shape = (n0 * 3, n1 * 2)
    rows = np.sort(
        np.unique(np.r_[0, data.draw(st.lists(st.integers(1, shape[0] - 1), max_size=4)), shape[0]])
    )
    cols = np.sort(
        np.unique(np.r_[0, data.draw(st.lists(st.integers(1, shape[1] - 1), max_size=4)), shape[1]])
    )
    starts = np.array([[r0, c0] for r0 in rows[:-1] for c0 in cols[:-1]])
    stops = np.array([[r1, c1] for r1 in rows[1:] for c1 in cols[1:]])
    idx = ChunkIndex(starts, stops)
    qs, qe = data.draw(boxes_in(shape))
    got = idx.overlapping(qs, qe).tolist()
    want = [i for i in range(len(starts)) if np.all(starts[i] < qe) and np.all(stops[i] > qs)]
    assert got == want


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=12),
    st.sampled_from([None, 8, 16]),
    st.integers(0, 10),
)
def test_coalesced_ranges_cover_every_run_and_whole_blocks(raw, block, gap):
    # Disjoint sorted runs inside a chunk.
    offs, lens, pos = [], [], 0
    for skip, n in raw:
        pos += skip
        offs.append(pos)
        lens.append(n)
        pos += n
    nbytes = pos + 3
    offs_a, lens_a = np.array(offs, np.int64), np.array(lens, np.int64)
    ranges = coalesce_runs(offs_a, lens_a, nbytes, block=block, max_gap=gap)
    # The plain-Python path for a few runs and the NumPy path agree.
    small, overlaps._SMALL = overlaps._SMALL, 0
    try:
        assert coalesce_runs(offs_a, lens_a, nbytes, block=block, max_gap=gap) == ranges
    finally:
        overlaps._SMALL = small
    covered = [False] * len(offs)
    for r in ranges:
        assert 0 <= r.start < r.stop <= nbytes
        for p in range(r.p0, r.p1):
            assert r.start <= offs[p] and offs[p] + lens[p] <= r.stop
            covered[p] = True
        if block:
            assert r.start % block == 0 and (r.stop % block == 0 or r.stop == nbytes)
    assert all(covered)
    for a, b in itertools.pairwise(ranges):
        assert a.stop <= b.start
        if not block:
            assert b.start - a.stop > gap
