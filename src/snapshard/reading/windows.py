"""Windowed reads: a range of many pieces read through a small scratch window, its rows
copied out while the window is still in the CPU's cache.

For column slices of row-major chunks on storage that reads cheaply in pieces (local
files): each window is read (and verified) and the complete rows of every overlap are
copied to their destinations before the next window lands; a row cut by a window's end
moves to the window's front. reads.py decides when a range goes this way.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..planning import RunGrid
from ..storage import Storage
from .buffers import Dest
from .plan import ReadTask
from .ranges import RangeReads, scratch_buffer, scratch_reused

# Where the storage reads cheaply in pieces, such a read goes through windows of at least
# this many bytes: the per-window work is small beside the copies, and a window stays in
# the CPU's cache between the read and the copies.
_WINDOW_BYTES = 1 << 20


def row_windows(task: ReadTask) -> list[tuple[int, RunGrid]] | None:
    """The overlaps a scratch read holds when it can copy them out window by window: each
    whole in the range and with rows (its first axis). None: read the whole range, then
    copy."""
    runs, r = task.runs, task.rng
    if r.p1 - r.p0 == sum(g.count for _, g in runs.grids):
        grids = runs.grids
    else:
        inside, n = np.unique(runs.sorted.overlap[r.p0 : r.p1], return_counts=True)
        grids = [runs.grids[k] for k in inside.tolist()]
        if any(g.count != m for (_, g), m in zip(grids, n.tolist(), strict=True)):
            return None
    if any(not g.outer_shape for _, g in grids):
        return None
    return grids


def window_bytes(grids: list[tuple[int, RunGrid]], piece: int, block: int) -> int | None:
    """The window of a windowed read: at least _WINDOW_BYTES, the read's piece and its
    longest row, in whole checksum blocks (so that a window's rows are copied out only
    once every block under them is checked). None: window and carried row together
    beyond the scratch reuse limit (read the whole range instead)."""
    longest = max(_row_extent(g) for _, g in grids)
    window = max(piece, _WINDOW_BYTES, longest)
    if block:
        window = -(-window // block) * block
    return window if scratch_reused(window + longest) else None


def _row_extent(g: RunGrid) -> int:
    """The bytes of the chunk that row 0 (index 0 on the first axis) of a grid spans."""
    return g.src_end - g.src_base - (g.outer_shape[0] - 1) * g.src_strides[0]


def _rows(g: RunGrid, lo: int, hi: int, src: np.ndarray, dest: np.ndarray) -> None:
    """Copy rows [lo, hi) of grid `g` from `src` (chunk bytes from g's row `lo` on)."""
    shape = (hi - lo, *g.outer_shape[1:], g.run_bytes)
    np.copyto(
        as_strided(dest[g.dst_base + lo * g.dst_strides[0] :], shape, (*g.dst_strides, 1)),
        as_strided(src, shape, (*g.src_strides, 1), writeable=False),
    )


def read_windowed(
    storage: Storage, task: ReadTask, grids: list[tuple[int, RunGrid]], dests: list[Dest],
    window: int, checked: bool,
) -> None:  # fmt: skip
    """Read a range `window` bytes at a time into a small scratch buffer, copying out every
    row of every overlap as soon as it is complete: the scratch stays in cache, and the
    bytes of a row cut by a window's end move to the buffer's front for the next one
    (fewer than a window: `window_bytes` makes windows at least a row long)."""
    r = task.rng
    reads = RangeReads(storage, task, checked)
    extents = [_row_extent(g) for _, g in grids]
    buf = scratch_buffer(window + max(extents))
    done = [0] * len(grids)  # rows copied, per overlap
    held = r.start  # the chunk offset of buf[0]
    while reads.at < r.stop:
        n = min(window, r.stop - reads.at)
        at = reads.at - held
        reads.read([buf.data[at : at + n]])
        keep = reads.at
        for k, (di, g) in enumerate(grids):
            s0, rows, first = g.src_strides[0], g.outer_shape[0], done[k]
            # Rows that end by the bytes read so far.
            upto = min(rows, max(first, (reads.at - g.src_base - extents[k]) // s0 + 1))
            if upto > first:
                _rows(g, first, upto, buf[g.src_base + first * s0 - held :], dests[di].buf)
                done[k] = upto
            if upto < rows:
                keep = min(keep, g.src_base + upto * s0)
        if keep > held:
            buf[: reads.at - keep] = buf[keep - held : reads.at - held]
            held = keep
