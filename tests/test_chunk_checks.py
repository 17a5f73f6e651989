"""check_array_rows (all arrays of a restore at once, their chunks the rows of one table)
finds exactly what check_chunks finds array by array, and names the same array and
problem."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshard.errors import CorruptCheckpointError
from snapshard.format import ArrayLeaf, ChunkTable, chunk_checks
from snapshard.format.chunk_checks import check_array_rows, check_chunks

FIELDS = ("starts", "stops", "file", "offset", "nbytes", "block", "crc_offset", "flags")


def check_chunk_tables(tables, where, itemsizes, file_sizes) -> None:
    """check_array_rows of the arrays' own tables put together, per number of axes (as the
    chunk finder hands it the records of many arrays)."""
    groups: dict[int, list[int]] = {}
    for k, (leaf, t) in enumerate(tables):
        if len(t):
            groups.setdefault(len(leaf.shape), []).append(k)
    for ks in groups.values():
        parts = [tables[k][1] for k in ks]
        counts = [len(p) for p in parts]
        check_array_rows(
            [tables[k][0] for k in ks],
            ChunkTable.concat(parts, parts[0].starts.shape[1]),
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            where,
            [itemsizes[k] for k in ks],
            file_sizes,
        )


@st.composite
def arrays(draw: st.DrawFn) -> tuple[ArrayLeaf, ChunkTable, int]:
    """A valid v2 table of one array (rows cut in up to 3 chunks, data then checksums laid
    out in one of two files), or one with a field of one chunk changed."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    itemsize = draw(st.sampled_from([1, 2, 4]))
    cuts = sorted(
        set(draw(st.lists(st.integers(1, shape[0] - 1), max_size=2)) if shape[0] > 1 else [])
    )
    rows = [0, *cuts, shape[0]]
    n = len(rows) - 1
    starts = np.zeros((n, ndim), np.int64)
    stops = np.tile(np.asarray(shape, np.int64), (n, 1))
    starts[:, 0], stops[:, 0] = rows[:-1], rows[1:]
    nbytes = np.prod(stops - starts, axis=1) * itemsize
    block = np.full(n, draw(st.sampled_from([4, 8, 64])), np.int64)
    offset = np.zeros(n, np.int64)
    crc_offset = np.zeros(n, np.int64)
    at = draw(st.integers(0, 16))
    for c in range(n):
        offset[c], at = at, at + int(nbytes[c])
        crc_offset[c], at = at, at + 4 * int(-(-nbytes[c] // block[c]))
    t = ChunkTable(
        starts, stops, np.full(n, draw(st.integers(0, 1)), np.int64), offset, nbytes, block,
        [], crc_offset, None,
    )  # fmt: skip
    if draw(st.booleans()):
        name = draw(st.sampled_from(FIELDS))
        c = draw(st.integers(0, n - 1))
        if name == "flags":
            t.flags = np.zeros(n, np.int64)
            t.flags[c] = 1
        else:
            col = getattr(t, name)
            value = draw(st.integers(-2, 200))
            if col.ndim == 2:
                col[c, draw(st.integers(0, ndim - 1))] = value
            else:
                col[c] = value
    leaf = ArrayLeaf(path=(f"a{draw(st.integers(0, 10**6))}",), kind="array", dtype="uint8",
                     shape=shape)  # fmt: skip
    return leaf, t, itemsize


def _first_failure(tables: list[tuple[ArrayLeaf, ChunkTable, int]], sizes: list[int]) -> str | None:
    order = sorted(range(len(tables)), key=lambda k: [len(t[0].shape) for t in tables].index(
        len(tables[k][0].shape)))  # fmt: skip
    for k in order:
        leaf, t, itemsize = tables[k]
        try:
            check_chunks(leaf, t, itemsize, sizes, leaf.name)
        except CorruptCheckpointError as e:
            return str(e)
    return None


def _one_by_one(*args: object) -> None:
    raise AssertionError("valid arrays were checked one by one")


@settings(max_examples=300, deadline=None)
@given(
    st.lists(arrays(), min_size=1, max_size=6),
    st.lists(st.integers(0, 400), min_size=2, max_size=2),
)
def test_all_at_once_finds_what_one_by_one_finds(
    tables: list[tuple[ArrayLeaf, ChunkTable, int]], sizes: list[int]
) -> None:
    want = _first_failure(tables, sizes)
    name = lambda leaf: leaf.name  # noqa: E731
    args = ([(leaf, t) for leaf, t, _ in tables], name, [i for *_, i in tables])
    if want is None:  # and the arrays were not checked one by one
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(chunk_checks, "check_chunks", _one_by_one)
            check_chunk_tables(*args, np.asarray(sizes, np.int64))
    else:
        with pytest.raises(CorruptCheckpointError) as got:
            check_chunk_tables(*args, np.asarray(sizes, np.int64))
        assert str(got.value) == want


def test_two_arrays_may_start_their_chunks_at_the_same_place() -> None:
    """Equal boxes of different arrays (every bias of a model) are no duplicate."""
    shape = (4,)
    tables = []
    for k in range(2):
        t = ChunkTable(
            np.zeros((1, 1), np.int64), np.full((1, 1), 4, np.int64), np.zeros(1, np.int64),
            np.asarray([8 * k]), np.asarray([4]), np.asarray([4]), [], np.asarray([4 + 8 * k]),
        )  # fmt: skip
        tables.append((ArrayLeaf((f"b{k}",), "array", "uint8", shape), t))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk_checks, "check_chunks", _one_by_one)
        check_chunk_tables(tables, lambda leaf: leaf.name, [1, 1], np.asarray([16], np.int64))
    tables[1][1].nbytes[0] = 5
    with pytest.raises(CorruptCheckpointError, match=r"^b1: chunk 0 has 5 bytes, its box needs 4"):
        check_chunk_tables(tables, lambda leaf: leaf.name, [1, 1], np.asarray([16], np.int64))
