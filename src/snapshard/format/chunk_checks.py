"""Checks of chunk tables: an array's chunks fit its shape and the files they lie in (a v1
manifest's tables as it is read, v2 records as the chunk finder fetches them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np

from ..errors import CorruptCheckpointError
from .chunks import ChunkTable
from .leaves import ArrayLeaf

_HEX = frozenset("0123456789abcdef")


def check_chunks(
    leaf: ArrayLeaf, t: ChunkTable, itemsize: int, file_sizes: list[int], name: str
) -> None:
    """An array's chunks fit its shape and their files: boxes inside the shape, byte counts
    that fill the boxes, data (and v2 checksums) inside a file of the manifest, checksums
    beside the data, no two chunks at one place."""
    if not len(t):
        return
    shape = np.asarray(leaf.shape, dtype=np.int64)
    checks = _chunk_checks(t, shape, itemsize, np.asarray(file_sizes, dtype=np.int64), None)
    if _any_problem(checks):
        for bad, explain in checks:
            if np.any(bad):
                raise CorruptCheckpointError(f"{name}: {explain(int(np.flatnonzero(bad)[0]))}")
    if t.crc_offset is not None:
        return
    for i in range(len(t)):
        if t.block[i] <= 0:
            raise CorruptCheckpointError(f"{name}: chunk {i} has checksum block size {t.block[i]}")
        nblocks = -(-int(t.nbytes[i]) // int(t.block[i]))
        crc = t.crc32c[i]
        if len(crc) != 8 * nblocks:
            raise CorruptCheckpointError(
                f"{name}: chunk {i} has {len(crc) // 8} checksums, needs {nblocks}"
            )
        if not _HEX.issuperset(crc):
            raise CorruptCheckpointError(f"{name}: chunk {i} has a checksum that is not hex")


def check_array_rows(
    leaves: list[ArrayLeaf],
    t: ChunkTable,
    bounds: np.ndarray,
    where: Callable[[ArrayLeaf], str],
    itemsizes: list[int],
    file_sizes: np.ndarray,
) -> None:
    """check_chunks of many arrays with the same number of axes, whose chunks are the rows
    of one table (`leaves[i]`'s: rows bounds[i]:bounds[i + 1], in box order): the checks
    of all rows in one pass, so that a restore of many arrays does not pay NumPy's cost per
    call per array. If a row has a problem, the arrays are checked one by one, for the
    message naming the array (`where(leaf)`)."""
    if not len(t):
        return
    counts = np.diff(bounds)
    first = np.zeros(len(t), bool)
    first[bounds[:-1][counts > 0]] = True
    shapes = np.asarray([leaf.shape for leaf in leaves], np.int64).reshape(len(leaves), -1)
    checks = _chunk_checks(
        t,
        np.repeat(shapes, counts, axis=0),
        np.repeat(np.asarray(itemsizes, np.int64), counts),
        file_sizes,
        first,
    )
    if _any_problem(checks):
        sizes = cast(list[int], file_sizes)
        for i, leaf in enumerate(leaves):
            table = t.between(int(bounds[i]), int(bounds[i + 1]))
            check_chunks(leaf, table, itemsizes[i], sizes, where(leaf))


def _any_problem(checks: list[tuple[np.ndarray, Callable[[int], str]]]) -> bool:
    """Whether any chunk fails any of `_chunk_checks` (one reduction, not one per check)."""
    return bool(np.any(np.logical_or.reduce([bad for bad, _ in checks])))


def _chunk_checks(
    t: ChunkTable,
    shape: np.ndarray,
    itemsize: int | np.ndarray,
    sizes: np.ndarray,
    first: np.ndarray | None,
) -> list[tuple[np.ndarray, Callable[[int], str]]]:
    """check_chunks' checks, in order: a mask over the chunks (True: the problem) and the
    message for chunk i. `shape` and `itemsize`: the array's, or one per chunk for the
    chunks of several arrays, with `first` marking each array's first chunk."""
    vol = np.prod(t.stops - t.starts, axis=1, dtype=np.int64)
    fsz = sizes[np.clip(t.file, 0, len(sizes) - 1)] if len(sizes) else np.zeros(len(t), np.int64)
    ends, crc_end = stored_extents(t)
    packed = t.flags is not None and bool(np.any(t.flags))
    checks: list[tuple[np.ndarray, Callable[[int], str]]] = [
        (
            np.any((t.starts < 0) | (t.stops > shape) | (t.stops <= t.starts), axis=1),
            lambda i: (
                f"chunk {i} box {box_text(t.starts[i], t.stops[i])} is empty or outside shape "
                f"{tuple(np.broadcast_to(shape, t.starts.shape)[i].tolist())}"
            ),
        ),
        (
            vol * itemsize != t.nbytes,
            lambda i: (
                f"chunk {i} has {t.nbytes[i]} bytes, its box needs "
                f"{vol[i] * np.broadcast_to(itemsize, vol.shape)[i]}"
            ),
        ),
        (
            (t.file < 0) | (t.file >= len(sizes)),
            lambda i: "chunk refers to a file not in the manifest",
        ),
    ]
    if packed:  # compressed chunks (encoding.py): the blocks end where their table starts
        assert t.flags is not None and t.crc_offset is not None
        on = t.flags != 0
        checks.append(
            (on & (t.crc_offset < t.offset), lambda i: "a compressed chunk ends before it starts")
        )
    checks.append(((t.offset < 0) | (ends > fsz), lambda i: f"chunk {i} lies outside its file"))
    if t.crc_offset is not None:
        checks += _checksum_checks(t, ends, crc_end, fsz, first)
    return checks


def _checksum_checks(
    t: ChunkTable,
    ends: np.ndarray,
    crc_end: np.ndarray,
    fsz: np.ndarray,
    first: np.ndarray | None,
) -> list[tuple[np.ndarray, Callable[[int], str]]]:
    """_chunk_checks' checks of v2 tables: checksums beside the data, nblocks uint32 values,
    in the chunk's file; no two chunks of an array starting at one place."""
    assert t.crc_offset is not None
    crc_offset = t.crc_offset
    dup = np.zeros(len(t), bool)
    if len(t) > 1:
        dup[:-1] = np.all(t.starts[1:] == t.starts[:-1], axis=1)
        if first is not None:
            dup[:-1] &= ~first[1:]
    checks: list[tuple[np.ndarray, Callable[[int], str]]] = [
        (t.block <= 0, lambda i: "a chunk has checksum block size 0"),
        (
            (crc_offset < 0) | (crc_end > fsz) | ((crc_offset < ends) & (crc_end > t.offset)),
            lambda i: f"chunk {i} has its checksums outside its file",
        ),
        (dup, lambda i: f"chunks {i} and {i + 1} start at the same place"),
    ]
    if t.nblocks is not None:  # the records' own counts (the checksum range follows)
        stated = t.nblocks
        checks.append((
            stated != -(-t.nbytes // np.maximum(t.block, 1)),
            lambda i: (
                f"chunk {i} says {stated[i]} checksum blocks of {t.block[i]} bytes for "
                f"{t.nbytes[i]} bytes"
            ),
        ))  # fmt: skip
    return checks


def stored_extents(t: ChunkTable) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk, where its stored data ends in its file (a compressed chunk's blocks end
    where its tables start; others after `nbytes`) and where its tables end (v2: the
    checksums, after a compressed chunk's block offsets; v1: no tables, the data's end)."""
    data_end = t.offset + t.nbytes
    if t.crc_offset is None:
        return data_end, data_end
    nblocks = -(-t.nbytes // np.maximum(t.block, 1))
    table_end = t.crc_offset + 4 * nblocks
    if t.flags is not None and bool(np.any(t.flags)):
        on = t.flags != 0
        data_end = np.where(on, t.crc_offset, data_end)
        table_end = np.where(on, t.crc_offset + 12 * nblocks + 8, table_end)
    return data_end, table_end


def box_text(start: np.ndarray, stop: np.ndarray) -> str:
    """A box as `[a:b, c:d]`, for messages."""
    return (
        "["
        + ", ".join(f"{a}:{b}" for a, b in zip(start.tolist(), stop.tolist(), strict=True))
        + "]"
    )
