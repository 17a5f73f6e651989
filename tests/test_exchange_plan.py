"""The pure plan of reshards read as bands of whole rows (planning/exchange.py)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshard.planning.exchange import cuts_rows, messages, row_bands, slabs


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
