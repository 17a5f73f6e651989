"""What to read: overlaps of target boxes with saved chunks, as byte runs and coalesced reads.

Pure functions over integers; no I/O. A box is a pair of int64 vectors [start, stop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


class ChunkIndex:
    """Finds the chunks of one array that overlap a box, without scanning every chunk.

    Chunks are sorted by their start on the axis cut into the most slabs (span over mean
    extent); a running maximum of their stops on that axis bounds the search from below, so
    a query costs two binary searches plus a filter over the chunks of one slab. Tables
    already sorted on that axis (as saves write them) are not sorted again.
    """

    def __init__(self, starts: np.ndarray, stops: np.ndarray):
        self.starts = np.asarray(starts, dtype=np.int64)
        self.stops = np.asarray(stops, dtype=np.int64)
        n, nd = self.starts.shape
        self.axis = 0
        self.order = np.arange(n)
        self._by_box: dict[bytes, int] | None = None
        if not (nd and n):
            return
        span = self.stops.max(axis=0) - self.starts.min(axis=0)
        slabs = span / np.maximum((self.stops - self.starts).mean(axis=0), 1e-9)
        self.axis = a = int(np.argmax(slabs))
        column = self.starts[:, a]
        if np.any(column[1:] < column[:-1]):
            self.order = np.argsort(column, kind="stable")
        self.sorted_starts = column[self.order]
        self.cummax_stops = np.maximum.accumulate(self.stops[self.order, a])

    def exact(self, start: np.ndarray, stop: np.ndarray) -> int:
        """The chunk whose box is exactly [start, stop), or -1 (restoring onto the saved
        layout, every target box is a chunk)."""
        if self._by_box is None:
            boxes = np.ascontiguousarray(np.concatenate([self.starts, self.stops], axis=1))
            self._by_box = {row.tobytes(): i for i, row in enumerate(boxes)}
        key = np.asarray(start, np.int64).tobytes() + np.asarray(stop, np.int64).tobytes()
        return self._by_box.get(key, -1)

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

    @property
    def source_contiguous(self) -> bool:
        """Whether the runs follow each other in the chunk (one contiguous byte range)."""
        size = self.run_bytes
        for n, stride in zip(reversed(self.outer_shape), reversed(self.src_strides), strict=True):
            if stride != size:
                return False
            size *= n
        return True

    @property
    def src_end(self) -> int:
        """One past the last byte of the last run in the chunk."""
        return (
            self.src_base
            + sum((n - 1) * st for n, st in zip(self.outer_shape, self.src_strides, strict=True))
            + self.run_bytes
        )

    def source_range(self, chunk_nbytes: int, block: int | None) -> ReadRange:
        """The one read of a source-contiguous grid (whole checksum blocks with `block`)."""
        return covering_range(self.src_base, self.src_end, chunk_nbytes, block, self.count)

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets in the chunk, offsets in the target) of every run, in C order."""
        if not self.outer_shape:
            return np.array([self.src_base], np.int64), np.array([self.dst_base], np.int64)
        grid = np.indices(self.outer_shape, dtype=np.int64).reshape(len(self.outer_shape), -1)
        src = self.src_base + np.asarray(self.src_strides, np.int64) @ grid
        dst = self.dst_base + np.asarray(self.dst_strides, np.int64) @ grid
        return src, dst


def covering_range(lo: int, hi: int, chunk_nbytes: int, block: int | None, runs: int) -> ReadRange:
    """One read of chunk bytes [lo, hi) holding `runs` runs (whole checksum blocks with `block`)."""
    if block:
        lo, hi = (lo // block) * block, min(-(-hi // block) * block, chunk_nbytes)
    return ReadRange(lo, hi, 0, runs)


def whole_grid(nbytes: int) -> RunGrid:
    """The single run of a target box that is exactly a chunk box."""
    return RunGrid((), (), (), 0, 0, nbytes)


def run_grid(
    chunk_start: np.ndarray,
    chunk_stop: np.ndarray,
    target_start: np.ndarray,
    target_stop: np.ndarray,
    ov_start: np.ndarray,
    ov_stop: np.ndarray,
    itemsize: int,
) -> RunGrid:
    """The runs of the overlap [ov_start, ov_stop) of a chunk box and a target box.

    Plain integers: a restore calls this once per overlap, and boxes have a few axes."""
    cs, ce = chunk_start.tolist(), chunk_stop.tolist()
    ts, te = target_start.tolist(), target_stop.tolist()
    os_, oe = ov_start.tolist(), ov_stop.tolist()
    nd = len(os_)
    if nd == 0:
        return RunGrid((), (), (), 0, 0, itemsize)
    ov = [b - a for a, b in zip(os_, oe, strict=True)]
    c_ext = [b - a for a, b in zip(cs, ce, strict=True)]
    t_ext = [b - a for a, b in zip(ts, te, strict=True)]
    j = next((a for a in range(nd - 1, -1, -1) if ov[a] != c_ext[a] or ov[a] != t_ext[a]), 0)
    c_str, t_str = [itemsize] * nd, [itemsize] * nd
    for a in range(nd - 2, -1, -1):
        c_str[a] = c_str[a + 1] * c_ext[a + 1]
        t_str[a] = t_str[a + 1] * t_ext[a + 1]
    return RunGrid(
        outer_shape=tuple(ov[:j]),
        src_strides=tuple(c_str[:j]),
        dst_strides=tuple(t_str[:j]),
        src_base=sum((o - c) * st for o, c, st in zip(os_, cs, c_str, strict=True)),
        dst_base=sum((o - t) * st for o, t, st in zip(os_, ts, t_str, strict=True)),
        run_bytes=math.prod(ov[j:]) * itemsize,
    )


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
    if n <= _SMALL:
        return _coalesce_small(offsets.tolist(), lengths.tolist(), chunk_nbytes, block, max_gap)
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


# Below this many runs, plain Python beats the fixed cost of NumPy calls.
_SMALL = 16


def _coalesce_small(
    offsets: list[int], lengths: list[int], chunk_nbytes: int, block: int | None, max_gap: int
) -> list[ReadRange]:
    """coalesce_runs for a few runs, with the same result."""
    out: list[ReadRange] = []
    gap = 0 if block else max_gap
    start = stop = first = 0
    for p, (off, n) in enumerate(zip(offsets, lengths, strict=True)):
        lo, hi = off, off + n
        if block:
            lo = (lo // block) * block
            hi = min(-(-hi // block) * block, chunk_nbytes)
        if p and lo <= stop + gap:
            stop = max(stop, hi)
            continue
        if p:
            out.append(ReadRange(start, stop, first, p))
        start, stop, first = lo, hi, p
    out.append(ReadRange(start, stop, first, len(offsets)))
    return out
