"""What to read: overlaps of target boxes with saved chunks, as byte runs and coalesced reads.

Pure functions over integers; no I/O. A box is a pair of int64 vectors [start, stop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class ChunkIndex:
    """Finds the chunks of one array that overlap a box, without scanning every chunk.

    Chunks are sorted by their start on the axis with the most distinct starts; a running
    maximum of their stops on that axis bounds the search from below, so a query costs two
    binary searches plus a filter over the chunks of one slab.
    """

    def __init__(self, starts: np.ndarray, stops: np.ndarray):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.stops = np.asarray(stops, dtype=np.int64)
        n, nd = self.starts.shape
        self.axis = 0
        if nd and n:
            distinct = [len(np.unique(self.starts[:, a])) for a in range(nd)]
            self.axis = int(np.argmax(distinct))
        if nd and n:
            self.order = np.argsort(self.starts[:, self.axis], kind="stable")
            self.sorted_starts = self.starts[self.order, self.axis]
            self.cummax_stops = np.maximum.accumulate(self.stops[self.order, self.axis])
        else:
            self.order = np.arange(n)

    def overlapping(self, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """Indices (ascending) of chunks whose box intersects [start, stop) with nonzero volume."""
        if self.starts.shape[1] == 0:
            return self.order
        if np.any(np.asarray(stop) <= np.asarray(start)):
            return np.zeros(0, dtype=np.int64)
        a = self.axis
        hi = int(np.searchsorted(self.sorted_starts, stop[a], side="left"))
        lo = int(np.searchsorted(self.cummax_stops, start[a], side="right"))
        cand = self.order[lo:hi]
        ok = np.all(self.starts[cand] < stop, axis=1) & np.all(self.stops[cand] > start, axis=1)
        return np.sort(cand[ok])


def strides(extent: np.ndarray) -> np.ndarray:
    """C-order element strides of a box with the given extents."""
    nd = len(extent)
    out = np.ones(nd, dtype=np.int64)
    for a in range(nd - 2, -1, -1):
        out[a] = out[a + 1] * extent[a + 1]
    return out


@dataclass(frozen=True)
class RunGrid:
    """The byte runs that copy one overlap box from a chunk to a target buffer (both C order).

    Runs are `run_bytes` long; run i (a multi-index over `outer_shape`) starts at
    src_base + i·src_strides in the chunk and dst_base + i·dst_strides in the target. Runs
    are as long as both sides allow: they span every trailing axis that the chunk and the
    target both hold whole.
    """

    outer_shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    src_base: int
    dst_base: int
    run_bytes: int

    @property
    def count(self) -> int:
        return math.prod(self.outer_shape)

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets in the chunk, offsets in the target) of every run, in C order."""
        if not self.outer_shape:
            return np.array([self.src_base], np.int64), np.array([self.dst_base], np.int64)
        grid = np.indices(self.outer_shape, dtype=np.int64).reshape(len(self.outer_shape), -1)
        src = self.src_base + np.asarray(self.src_strides, np.int64) @ grid
        dst = self.dst_base + np.asarray(self.dst_strides, np.int64) @ grid
        return src, dst


def run_grid(
    chunk_start: np.ndarray,
    chunk_stop: np.ndarray,
    target_start: np.ndarray,
    target_stop: np.ndarray,
    ov_start: np.ndarray,
    ov_stop: np.ndarray,
    itemsize: int,
) -> RunGrid:
    """The runs of the overlap [ov_start, ov_stop) of a chunk box and a target box."""
    ov_ext = ov_stop - ov_start
    c_ext = chunk_stop - chunk_start
    t_ext = target_stop - target_start
    if len(ov_ext) == 0:
        return RunGrid((), (), (), 0, 0, itemsize)
    partial = np.flatnonzero((ov_ext != c_ext) | (ov_ext != t_ext))
    j = int(partial[-1]) if len(partial) else 0
    c_str, t_str = strides(c_ext) * itemsize, strides(t_ext) * itemsize
    return RunGrid(
        outer_shape=tuple(int(x) for x in ov_ext[:j]),
        src_strides=tuple(int(x) for x in c_str[:j]),
        dst_strides=tuple(int(x) for x in t_str[:j]),
        src_base=int(np.dot(ov_start - chunk_start, c_str)),
        dst_base=int(np.dot(ov_start - target_start, t_str)),
        run_bytes=int(np.prod(ov_ext[j:], dtype=np.int64)) * itemsize,
    )


def overlap_runs(
    chunk_start: np.ndarray,
    chunk_stop: np.ndarray,
    target_start: np.ndarray,
    target_stop: np.ndarray,
    ov_start: np.ndarray,
    ov_stop: np.ndarray,
    itemsize: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(offsets in the chunk, offsets in the target, run length in bytes) of an overlap."""
    g = run_grid(chunk_start, chunk_stop, target_start, target_stop, ov_start, ov_stop, itemsize)
    src, dst = g.runs()
    return src, dst, g.run_bytes


@dataclass(frozen=True)
class ReadRange:
    """One contiguous read from a chunk: bytes [start, stop) relative to the chunk.

    pieces [p0, p1) of the chunk's sorted runs lie inside it; the bytes between them are
    read into scratch (to verify whole checksum blocks, or because the gap was small).
    """

    start: int
    stop: int
    p0: int
    p1: int


def coalesce_runs(
    offsets: np.ndarray,
    lengths: np.ndarray,
    chunk_nbytes: int,
    *,
    block: int | None,
    max_gap: int,
) -> list[ReadRange]:
    """Turn sorted, disjoint runs of one chunk into a few contiguous reads.

    With `block` (verification on), every checksum block a run touches is read whole, so it
    can be checked; touching blocks merge. Without it, runs merge when the gap between them
    is at most `max_gap` bytes.
    """
    n = len(offsets)
    if n == 0:
        return []
    ends = offsets + lengths
    if block:
        lo = (offsets // block) * block
        hi = np.minimum(-(-ends // block) * block, chunk_nbytes)
        gap = 0
    else:
        lo, hi, gap = offsets, ends, max_gap
    run_max = np.maximum.accumulate(hi)
    new = np.ones(n, dtype=bool)
    new[1:] = lo[1:] > run_max[:-1] + gap
    first = np.flatnonzero(new)
    last = np.append(first[1:], n)
    return [
        ReadRange(int(lo[a]), int(run_max[b - 1]), int(a), int(b))
        for a, b in zip(first, last, strict=True)
    ]
