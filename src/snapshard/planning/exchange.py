"""Reshards read once: when target boxes cut the saved boxes' rows, read whole rows, then
exchange.

A target that cuts the saved boxes along a later axis than their first (the columns of
`Shard(0)` chunks restored onto `Shard(1)`, a tensor-parallel degree changed) needs part
of every row of those boxes. Its bytes in a saved chunk are not contiguous, and checked
reads take whole checksum blocks, which span many rows: every process that holds a
column slice reads the whole chunk, so the job reads the unique bytes once per column
slice. Instead, each process reads one band of whole rows of the array (contiguous in
every chunk, so read once, exactly), and the bands are exchanged into the target boxes
over the job's collectives.

Pure: boxes in, a decision and messages out. Every process computes the same plan from
the same layouts, with no communication.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Moves ascending cuts of axis 0 but those marked fixed, keeping them ascending (e.g.
# `block_aligned` with its saved boxes bound).
Align = Callable[[np.ndarray, np.ndarray], np.ndarray]


def cuts_rows(
    saved_starts: np.ndarray, saved_stops: np.ndarray,
    target_starts: np.ndarray, target_stops: np.ndarray,
) -> bool:  # fmt: skip
    """Whether target boxes cut saved boxes along an axis k ≥ 1 while the saved boxes span
    more than one index on an earlier axis: their overlaps are then strided in the chunks.

    Boxes are (n, ndim) int64 [start, stop). The test is per axis, on the union of the
    boundaries (exact for grid layouts; for others it may say yes where no overlap is
    strided, which costs an exchange, never a wrong byte)."""
    ndim = saved_starts.shape[1] if saved_starts.ndim == 2 else 0
    for k in range(1, ndim):
        saved_cuts = np.union1d(saved_starts[:, k], saved_stops[:, k])
        target_cuts = np.union1d(target_starts[:, k], target_stops[:, k])
        if not np.isin(target_cuts, saved_cuts).all() and np.any(
            saved_stops[:, :k] - saved_starts[:, :k] > 1
        ):
            return True
    return False


def row_bands(
    shape: tuple[int, ...], parts: int, align: Align | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """`parts` boxes of whole rows (cuts of axis 0 only, as even as whole rows allow; some
    empty where rows are fewer than parts): the boxes the processes read. `align` moves
    the cuts (e.g. `block_aligned`)."""
    rows = shape[0] if shape else 0
    edges = np.arange(parts + 1, dtype=np.int64) * rows // parts
    if align is not None:
        edges = align(edges, np.isin(np.arange(parts + 1), [0, parts]))
    starts = np.zeros((parts, len(shape)), np.int64)
    stops = np.tile(np.asarray(shape, np.int64), (parts, 1))
    starts[:, 0], stops[:, 0] = edges[:-1], edges[1:]
    return starts, stops


def slabs(
    band_starts: np.ndarray, band_stops: np.ndarray, count: int, align: Align | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every band cut into `count` slabs of whole rows (as even as rows allow): slab j of
    every band together is one exchange, so that a large array moves in steps of bounded
    memory. The slabs of all steps tile the bands. `align` moves the cuts inside the
    bands, as in `row_bands`."""
    lo, n = band_starts[:, 0], band_stops[:, 0] - band_starts[:, 0]
    j = np.arange(count + 1, dtype=np.int64)
    edges = lo[:, None] + j[None, :] * n[:, None] // count  # (bands, count + 1), ascending
    if align is not None:
        fixed = np.zeros(edges.shape, bool)
        fixed[:, [0, count]] = True
        edges = align(edges.reshape(-1), fixed.reshape(-1)).reshape(edges.shape)
    out = []
    for k in range(count):
        starts, stops = band_starts.copy(), band_stops.copy()
        starts[:, 0], stops[:, 0] = edges[:, k], edges[:, k + 1]
        out.append((starts, stops))
    return out


def block_aligned(
    rows: np.ndarray, fixed: np.ndarray, saved_starts: np.ndarray, saved_stops: np.ndarray,
    itemsize: int, block: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """Ascending cuts of axis 0 (band and slab edges), each moved down to the nearest row at
    which the saved chunk around it begins a checksum block, where that keeps the cuts as
    ascending as they were: a checked read then never takes one block on both sides of a
    cut, i.e. twice. Cuts where `fixed` is true stay, and equal cuts move together.

    `block`: the checksum block bytes of each saved box. Row r of a chunk starting at row
    r0 begins a block when (r - r0) * row_bytes is a multiple of the block, i.e. every
    `block / gcd(block, row_bytes)` rows. Cuts are kept as given where the chunks' row
    ranges are not one sequence of disjoint intervals (a grid layout is), or where moving
    a cut would empty a slab."""
    rows = np.asarray(rows, np.int64)
    if saved_starts.ndim != 2 or saved_starts.shape[1] == 0 or len(saved_starts) == 0:
        return rows
    shape = saved_stops - saved_starts
    row_bytes = np.prod(shape[:, 1:], axis=1, dtype=np.int64) * itemsize
    grain = np.asarray(block, np.int64) // np.gcd(np.asarray(block, np.int64), row_bytes)
    spans, inv = np.unique(
        np.stack([saved_starts[:, 0], saved_stops[:, 0]], 1), axis=0, return_inverse=True
    )
    inv = inv.reshape(-1)
    lo, hi = spans[:, 0], spans[:, 1]
    if np.any(lo[1:] < hi[:-1]):  # row ranges overlap: not a grid
        return rows
    step = np.ones(len(spans), np.int64)
    np.lcm.at(step, inv, np.maximum(grain, 1))  # aligned for every chunk of the row range
    i = np.searchsorted(lo, rows, side="right") - 1
    ok = i >= 0
    i = np.maximum(i, 0)
    inside = ok & (rows > lo[i]) & (rows < hi[i])
    fixed = np.isin(rows, rows[fixed])  # a cut fixed anywhere is fixed everywhere
    out = np.where(inside & ~fixed, lo[i] + (rows - lo[i]) // step[i] * step[i], rows)
    while True:  # undo the moves that would make a cut meet or pass the one before it
        back = (out[1:] < out[:-1]) | ((rows[1:] > rows[:-1]) & (out[1:] == out[:-1]))
        bad = np.flatnonzero(back) + 1
        if not len(bad):
            return out
        undo = np.isin(rows, rows[bad])
        out[undo] = rows[undo]


@dataclass(frozen=True)
class Messages:
    """The pieces of one array that move from the process reading a band to the process
    holding a target box, one row per (band, target box) overlap, sorted by (sender,
    receiver, target): `sender`, `receiver`, `target` (the target box's index in the boxes
    given), and the piece's box [start, stop) in the array's coordinates."""

    sender: np.ndarray  # (m,)
    receiver: np.ndarray  # (m,)
    target: np.ndarray  # (m,)
    start: np.ndarray  # (m, ndim)
    stop: np.ndarray  # (m, ndim)

    @property
    def elements(self) -> np.ndarray:
        return np.prod(self.stop - self.start, axis=1, dtype=np.int64)

    def between(self, sender: int | None = None, receiver: int | None = None) -> np.ndarray:
        """Rows sent by `sender` and/or received by `receiver`, in order."""
        keep = np.ones(len(self.sender), bool)
        if sender is not None:
            keep &= self.sender == sender
        if receiver is not None:
            keep &= self.receiver == receiver
        return np.flatnonzero(keep)


def messages(
    band_starts: np.ndarray, band_stops: np.ndarray,
    target_starts: np.ndarray, target_stops: np.ndarray, holders: np.ndarray,
) -> Messages:  # fmt: skip
    """The overlaps of row bands (band p is read by process p) with target boxes (box i held
    by process holders[i]); empty overlaps are left out."""
    lo = np.searchsorted(band_stops[:, 0], target_starts[:, 0], side="right")
    hi = np.searchsorted(band_starts[:, 0], target_stops[:, 0], side="left")
    counts = np.maximum(hi - lo, 0)
    box = np.repeat(np.arange(len(target_starts)), counts)
    before = np.cumsum(counts) - counts  # messages of the boxes before each
    sender = np.repeat(lo - before, counts) + np.arange(len(box))
    start = np.maximum(band_starts[sender], target_starts[box])
    stop = np.minimum(band_stops[sender], target_stops[box])
    keep = np.all(stop > start, axis=1)
    sender, box, start, stop = sender[keep], box[keep], start[keep], stop[keep]
    receiver = holders[box]
    order = np.lexsort((box, receiver, sender))
    return Messages(sender[order], receiver[order], box[order], start[order], stop[order])
