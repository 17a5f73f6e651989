"""The pure plan of reshards read as bands of whole rows (planning/exchange.py)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshard.planning.exchange import block_aligned, cuts_rows, messages, row_bands, slabs


@st.composite
def grids(draw, shape):
    """A grid layout of `shape`: per axis, sorted cut points; boxes are their products."""
    edges = []
    for n in shape:
        inner = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3)) if n > 1 else []
        edges.append(sorted({0, n, *inner}))
    boxes = list(itertools.product(*[list(itertools.pairwise(e)) for e in edges]))
    starts = np.array([[a for a, _ in b] for b in boxes], np.int64).reshape(-1, len(shape))
    stops = np.array([[e for _, e in b] for b in boxes], np.int64).reshape(-1, len(shape))
    return starts, stops


shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)


def _strided(box_start, box_stop, lo, hi) -> bool:
    """Brute force: whether the elements [lo, hi) of a box are not one C-order range of it."""
    shape = box_stop - box_start
    idx = np.indices(tuple(hi - lo)).reshape(len(shape), -1).T + (lo - box_start)
    flat = np.ravel_multi_index(idx.T, tuple(shape))
    return bool(flat.max() - flat.min() + 1 != len(flat))


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_cuts_rows_says_yes_whenever_an_overlap_is_strided(data):
    shape = data.draw(shapes)
    ss, se = data.draw(grids(shape))
    ts, te = data.draw(grids(shape))
    strided = False
    for (a, b), (c, d) in itertools.product(zip(ss, se, strict=True), zip(ts, te, strict=True)):
        lo, hi = np.maximum(a, c), np.minimum(b, d)
        if np.all(hi > lo) and _strided(a, b, lo, hi):
            strided = True
    if strided:
        assert cuts_rows(ss, se, ts, te)
    # The same layout, or any cut of the first axis alone, reads contiguous pieces.
    assert not cuts_rows(ss, se, ss, se)
    bs, be = row_bands(shape, 3)
    assert not cuts_rows(ss, se, bs, be)


def test_cuts_rows_examples():
    rows = (np.array([[0, 0], [4, 0]]), np.array([[4, 6], [8, 6]]))  # Shard(0) of (8, 6)
    cols = (np.array([[0, 0], [0, 3]]), np.array([[8, 3], [8, 6]]))  # Shard(1)
    assert cuts_rows(*rows, *cols)
    assert not cuts_rows(*cols, *rows)  # rows of a column chunk are contiguous in it
    one_row = (np.array([[0, 0], [1, 0]]), np.array([[1, 6], [2, 6]]))  # (2, 6) saved by rows
    assert not cuts_rows(*one_row, np.array([[0, 0], [0, 3]]), np.array([[2, 3], [2, 6]]))


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_messages_tile_every_target_box_once_from_the_bands(data):
    shape = data.draw(shapes)
    world = data.draw(st.integers(1, 6))
    ts, te = data.draw(grids(shape))
    holders = np.array(data.draw(st.lists(st.integers(0, world - 1), min_size=len(ts),
                                          max_size=len(ts))), np.int64)  # fmt: skip
    bs, be = row_bands(shape, world)
    # bands: whole rows, in order, tiling the first axis
    assert bs[0, 0] == 0 and be[-1, 0] == shape[0] and np.all(bs[1:, 0] == be[:-1, 0])
    assert np.all(bs[:, 1:] == 0) and np.all(be[:, 1:] == np.asarray(shape[1:]))
    m = messages(bs, be, ts, te, holders)
    key = np.stack([m.sender, m.receiver, m.target], axis=1)
    assert np.array_equal(key, key[np.lexsort(key.T[::-1])])  # sorted by (sender, receiver, box)
    assert np.array_equal(m.receiver, holders[m.target])
    count = np.zeros(shape, np.int64)
    for i in range(len(m.sender)):
        assert np.all(m.start[i] >= bs[m.sender[i]]) and np.all(m.stop[i] <= be[m.sender[i]])
        assert np.all(m.start[i] >= ts[m.target[i]]) and np.all(m.stop[i] <= te[m.target[i]])
        count[tuple(slice(a, b) for a, b in zip(m.start[i], m.stop[i], strict=True))] += 1
    assert np.all(count == 1)  # the grid's boxes tile the array, each piece sent once
    assert int(m.elements.sum()) == int(np.prod(shape))
    for p in range(world):
        rows = m.between(sender=p)
        assert np.array_equal(rows, np.flatnonzero(m.sender == p))
        got = m.between(receiver=p)
        assert np.array_equal(got, np.flatnonzero(m.receiver == p))
        assert np.all(np.diff(m.sender[got]) >= 0)  # a receiver's pieces in sender order


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_slabs_tile_the_bands(data):
    shape = data.draw(shapes)
    world = data.draw(st.integers(1, 5))
    count = data.draw(st.integers(1, 9))
    bs, be = row_bands(shape, world)
    parts = slabs(bs, be, count)
    assert len(parts) == count
    for p in range(world):
        rows = [(int(s[p, 0]), int(e[p, 0])) for s, e in parts]
        assert rows[0][0] == bs[p, 0] and rows[-1][1] == be[p, 0]
        assert all(a <= b for a, b in rows) and all(
            rows[j][1] == rows[j + 1][0] for j in range(count - 1)
        )
        assert all(np.array_equal(s[p, 1:], bs[p, 1:]) and np.array_equal(e[p, 1:], be[p, 1:])
                   for s, e in parts)  # fmt: skip


def _blocks_read(starts, stops, itemsize, block, lo, hi):
    """Brute force: (chunk, block) pairs a checked read of rows [lo, hi) of every chunk
    takes, for each chunk as one C-order byte range."""
    out = set()
    for c, (a, b) in enumerate(zip(starts, stops, strict=True)):
        r0, r1 = max(lo, int(a[0])), min(hi, int(b[0]))
        if r1 <= r0:
            continue
        row = int(np.prod(b[1:] - a[1:])) * itemsize
        first, last = (r0 - int(a[0])) * row, (r1 - int(a[0])) * row
        out |= {(c, k) for k in range(first // int(block[c]), -(-last // int(block[c])))}
    return out


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_block_aligned_moves_cuts_down_onto_blocks_and_keeps_their_order(data):
    rows = data.draw(st.integers(1, 40))
    cols = data.draw(st.integers(1, 6))
    ss, se = data.draw(grids((rows, cols)))
    itemsize = data.draw(st.sampled_from([1, 2, 4]))
    nbytes = np.prod(se - ss, axis=1) * itemsize
    block = np.array([data.draw(st.integers(1, max(1, int(n)))) for n in nbytes])
    inner = data.draw(st.lists(st.integers(0, rows), max_size=8))
    cuts = np.array(sorted([0, rows, *inner]), np.int64)
    fixed = np.array([data.draw(st.booleans()) for _ in cuts])
    fixed[[0, -1]] = True
    out = block_aligned(cuts, fixed, ss, se, itemsize, block)
    assert np.all(out <= cuts) and np.array_equal(out[fixed], cuts[fixed])
    d_in, d_out = np.diff(cuts), np.diff(out)
    assert np.all(d_out[d_in > 0] > 0) and np.all(d_out[d_in == 0] == 0)
    for r in set(out[out != cuts].tolist()):  # a moved cut begins a block of each chunk
        for c, (a, b) in enumerate(zip(ss, se, strict=True)):
            if a[0] < r < b[0]:
                row = int(np.prod(b[1:] - a[1:])) * itemsize
                assert (r - a[0]) * row % block[c] == 0


@given(st.data())
@settings(max_examples=100, deadline=None)
def test_aligned_bands_and_slabs_tile_the_rows(data):
    rows = data.draw(st.integers(1, 40))
    cols = data.draw(st.integers(1, 6))
    ss, se = data.draw(grids((rows, cols)))
    block = np.array([data.draw(st.integers(1, int(n))) for n in np.prod(se - ss, axis=1)])
    world, count = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))

    def align(r, fixed):
        return block_aligned(r, fixed, ss, se, 1, block)

    bs, be = row_bands((rows, cols), world, align)
    assert bs[0, 0] == 0 and be[-1, 0] == rows and np.array_equal(bs[1:, 0], be[:-1, 0])
    parts = slabs(bs, be, count, align)
    for p in range(world):
        edges = [int(bs[p, 0])] + [int(e[p, 0]) for _, e in parts]
        assert edges == sorted(edges) and edges[-1] == be[p, 0]
        assert all(int(parts[k][0][p, 0]) == edges[k] for k in range(count))


def test_aligned_slabs_read_each_block_once():
    # Shard(0) of a (100, 5) f32 array in 2 chunks: 160-byte blocks, so every 8 rows.
    ss, se = np.array([[0, 0], [50, 0]]), np.array([[50, 5], [100, 5]])
    block = np.array([160, 160])

    def reads(align):
        bs, be = row_bands((100, 5), 3, align)
        got = []
        for s, e in slabs(bs, be, 2, align):
            for p in range(3):
                got += sorted(_blocks_read(ss, se, 4, block, int(s[p, 0]), int(e[p, 0])))
        return got

    aligned = reads(lambda r, fixed: block_aligned(r, fixed, ss, se, 4, block))
    assert sorted(aligned) == sorted(set(aligned)) and len(aligned) == 2 * -(-50 * 20 // 160)
    assert len(reads(None)) > len(aligned)  # unaligned cuts take some blocks twice


def test_block_aligned_example():
    # 2 chunks of 8 rows, 4-byte rows, 8-byte blocks: blocks begin at every other row.
    ss, se = np.array([[0, 0], [8, 0]]), np.array([[8, 1], [16, 1]])
    block = np.array([8, 8])
    cuts = np.array([0, 3, 5, 5, 8, 11, 16])
    free = np.zeros(len(cuts), bool)
    assert block_aligned(cuts, free, ss, se, 4, block).tolist() == [0, 2, 4, 4, 8, 10, 16]
    fixed = free.copy()
    fixed[1] = True
    assert block_aligned(cuts, fixed, ss, se, 4, block).tolist() == [0, 3, 4, 4, 8, 10, 16]
    # a move that would empty a slab is undone, for every copy of that cut
    cuts = np.array([0, 2, 3, 3, 16])
    assert block_aligned(cuts, free[:5], ss, se, 4, block).tolist() == [0, 2, 3, 3, 16]
