"""The read plan: which byte ranges of which chunks fill a batch's host buffers.

Pure functions over the chunk tables and the destination boxes; no I/O. Each destination
box is checked to be tiled exactly once by the chunks overlapping it; each overlap becomes a
`RunGrid` (planning/read_plan.py); the grids of one chunk become its reads (`ReadTask`),
coalesced per checksum block (verified) or within `max_gap` (unverified). Whole one-block
chunks lying back to back in a file merge into `ChunkRun`s, and `jobs` groups the reads for
the read threads. The reads themselves are done by reads.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..dtypes import dtype_from_name
from ..errors import CorruptCheckpointError
from ..format import ArrayLeaf, ChunkTable, FileEntry
from ..format.validate import coverage_problems
from ..planning import ChunkIndex, ReadRange, RunGrid, coalesce_runs, run_grid, whole_grid
from ..planning.read_plan import covering_range
from .buffers import Dest, ReadStats


@dataclass
class ChunkRuns:
    """Every run this process needs from one chunk. The per-run arrays, sorted by chunk
    offset, are built on first use: usually by the reading thread, off the planning path."""

    leaf: ArrayLeaf
    table: ChunkTable
    chunk: int
    file: str
    file_offset: int  # where the chunk starts in its file
    grids: list[tuple[int, RunGrid]]  # (dest index, runs) of each overlap

    @cached_property
    def _sorted(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        expanded = [g.runs() for _, g in self.grids]
        sizes = [g.count for _, g in self.grids]
        src = np.concatenate([e[0] for e in expanded])
        order = np.argsort(src, kind="stable")
        return (
            src[order],
            np.repeat(np.array([g.run_bytes for _, g in self.grids], np.int64), sizes)[order],
            np.repeat(np.array([di for di, _ in self.grids], np.int64), sizes)[order],
            np.concatenate([e[1] for e in expanded])[order],
            np.repeat(np.arange(len(self.grids)), sizes)[order],
        )

    @property
    def src(self) -> np.ndarray:  # run offsets in the chunk
        return self._sorted[0]

    @property
    def length(self) -> np.ndarray:
        return self._sorted[1]

    @property
    def dest(self) -> np.ndarray:  # index into the batch's dest list
        return self._sorted[2]

    @property
    def dst(self) -> np.ndarray:  # run offsets in the destination buffer
        return self._sorted[3]

    @property
    def overlap(self) -> np.ndarray:  # index into `grids`
        return self._sorted[4]


@dataclass
class ReadTask:
    """One contiguous read of a chunk."""

    runs: ChunkRuns
    rng: ReadRange


# Overlaps that need this much of the span they cover are read as that one span.
_DENSE = 0.98

# Small reads are handed to the read threads in jobs of up to this many bytes (`jobs`).
_JOB_BYTES = 1 << 20
_JOBS_PER_THREAD = 4


def verified(verify: bool, t: ChunkTable, c: int) -> bool:
    """Chunks with checksum block size 0 have no checksums (tables of other formats)."""
    return verify and int(t.block[c]) > 0


def _covered(
    index: ChunkIndex, t: ChunkTable, d: Dest, exact: int, url: str, seen: dict[Any, np.ndarray]
) -> np.ndarray:
    """The chunks overlapping dest `d`, after checking that they tile its box exactly once
    (the planner guarantees it for what snapshard writes; a damaged checkpoint may not).
    Arrays sharing their chunk boxes share the answer (`seen`)."""
    key = (id(index), d.start.tobytes(), d.stop.tobytes())
    done = seen.get(key)
    if done is not None:
        return done
    over = seen[key] = _check_cover(index, t, d, exact, url)
    return over


def _check_cover(index: ChunkIndex, t: ChunkTable, d: Dest, exact: int, url: str) -> np.ndarray:
    over = index.overlapping(d.start, d.stop)
    if exact >= 0 and len(over) == 1:
        return over
    lo = np.maximum(t.starts[over], d.start) - d.start
    hi = np.minimum(t.stops[over], d.stop) - d.start
    missing, twice = coverage_problems(d.shape, lo, hi)
    if missing or twice:
        box = ", ".join(f"{a}:{b}" for a, b in zip(d.start.tolist(), d.stop.tolist(), strict=True))
        what = (f"no chunk holds {', '.join(missing)}" if missing
                else f"more than one chunk holds {', '.join(twice)}")  # fmt: skip
        raise CorruptCheckpointError(
            f"{url}: leaf {d.leaf.name!r}, box [{box}]: {what} (relative to the box)"
        )
    return over


def plan_tasks(
    files: Sequence[FileEntry],
    dests: list[Dest],
    tables: dict[int, ChunkTable],
    verify: bool,
    max_gap: int,
    stats: ReadStats,
    url: str = "",
) -> list[ReadTask]:
    """The reads that fill `dests` from the chunks of `tables` (`files`: the checkpoint's
    file list, by the tables' file numbers), each checked to be covered exactly once."""
    per_chunk, leaves = _overlaps(dests, tables, stats, url)
    tasks = []
    for (key, c), grids in per_chunk.items():
        leaf = leaves[key]
        t = tables[key]
        block = int(t.block[c]) if verified(verify, t, c) else None
        runs = ChunkRuns(leaf, t, c, files[int(t.file[c])].name, int(t.offset[c]), grids)
        stats.chunks_touched += 1
        for r in _chunk_ranges(runs, grids, int(t.nbytes[c]), block, max_gap):
            stats.bytes_read += r.stop - r.start
            stats.reads += 1
            tasks.append(ReadTask(runs, r))
    return tasks


_Overlaps = dict[tuple[int, int], list[tuple[int, RunGrid]]]


def _overlaps(
    dests: list[Dest], tables: dict[int, ChunkTable], stats: ReadStats, url: str
) -> tuple[_Overlaps, dict[int, ArrayLeaf]]:
    """Per (leaf, chunk): the dests it overlaps, each with the grid of runs the overlap is
    made of; and the leaves by id."""
    # Arrays with the same chunk boxes share their box columns (interned when the manifest is
    # read), hence one index.
    indexes: dict[int, ChunkIndex] = {}
    covered: dict[Any, np.ndarray] = {}
    grid_cache: dict[Any, RunGrid] = {}  # overlaps of arrays with equal boxes are equal
    per_chunk: _Overlaps = {}
    leaves: dict[int, ArrayLeaf] = {}
    for di, d in enumerate(dests):
        leaf = d.leaf
        t = tables[id(leaf)]
        key = id(leaf)
        leaves[key] = leaf
        index = indexes.get(id(t.starts))
        if index is None:
            index = indexes[id(t.starts)] = ChunkIndex(t.starts, t.stops)
        stats.bytes_needed += d.buf.nbytes
        exact = index.exact(d.start, d.stop) if t.stores_own_boxes else -1
        over = _covered(index, t, d, exact, url, covered)
        if exact >= 0:  # the box is a chunk: one run, the whole of both
            per_chunk.setdefault((key, exact), []).append((di, whole_grid(d.buf.nbytes)))
            continue
        itemsize = dtype_from_name(leaf.dtype).itemsize
        box = (id(t.starts), d.start.tobytes(), d.stop.tobytes(), itemsize)
        for c in over.tolist():
            gk = (*box, c)
            grid = grid_cache.get(gk) if t.stores_own_boxes else None
            if grid is None:
                os_, oe = np.maximum(t.starts[c], d.start), np.minimum(t.stops[c], d.stop)
                stored_start, stored_stop = t.storage_box(c)
                grid = run_grid(stored_start, stored_stop, d.start, d.stop, os_, oe, itemsize)
                grid_cache[gk] = grid
            per_chunk.setdefault((key, c), []).append((di, grid))
    return per_chunk, leaves


def _chunk_ranges(
    runs: ChunkRuns,
    grids: list[tuple[int, RunGrid]],
    nbytes: int,
    block: int | None,
    max_gap: int,
) -> list[ReadRange]:
    """The byte ranges of one chunk (of `nbytes`) to read for its overlaps `grids`."""
    if len(grids) == 1 and grids[0][1].source_contiguous:
        # One overlap, one byte range of the chunk (a box restored onto the saved layout).
        return [grids[0][1].source_range(nbytes, block)]
    if all(g.source_contiguous for _, g in grids):
        # Each overlap is one byte range of the chunk: coalesce those, not every run.
        grids.sort(key=lambda dg: dg[1].src_base)
        return _coalesce_grids([g for _, g in grids], nbytes, block, max_gap)
    lo = min(g.src_base for _, g in grids)
    hi = max(g.src_end for _, g in grids)
    needed = sum(g.count * g.run_bytes for _, g in grids)
    whole = covering_range(lo, hi, nbytes, block, sum(g.count for _, g in grids))
    if needed >= _DENSE * (whole.stop - whole.start):
        # Interleaved overlaps that fill their span (other targets' columns of the same
        # rows): one read, no per-run work at all.
        return [whole]
    return coalesce_runs(runs.src, runs.length, nbytes, block=block, max_gap=max_gap)


def _coalesce_grids(
    grids: list[RunGrid], nbytes: int, block: int | None, max_gap: int
) -> list[ReadRange]:
    """Reads of source-contiguous overlaps sorted by offset (their runs, in that order, are
    the chunk's sorted runs): ranges that touch (with `block`) or nearly do merge."""
    out: list[ReadRange] = []
    p = 0
    for g in grids:
        r = g.source_range(nbytes, block)
        r = ReadRange(r.start, r.stop, p, p + g.count)
        p += g.count
        if out and r.start <= out[-1].stop + (0 if block else max_gap):
            last = out[-1]
            out[-1] = ReadRange(last.start, max(last.stop, r.stop), last.p0, r.p1)
        else:
            out.append(r)
    return out


@dataclass
class ChunkRun:
    """Whole chunks of one checksum block lying back to back in one file, each followed by
    its checksum: read with one request, then checked chunk by chunk."""

    tasks: list[ReadTask]
    nbytes: int  # in the file, checksums included


def _whole_chunk(task: ReadTask, verify: bool) -> bool:
    """Whether a read is a whole verified chunk of one block, uncompressed, its checksum
    right after it and its bytes one piece of one destination (a small array restored
    onto its saved layout)."""
    runs, r = task.runs, task.rng
    t, c = runs.table, runs.chunk
    if len(runs.grids) != 1 or runs.grids[0][1].count != 1 or t.crc_offset is None:
        return False
    n = int(t.nbytes[c])
    g = runs.grids[0][1]
    return (
        0 < n <= int(t.block[c])
        and r.start == 0 and r.stop == n and g.src_base == 0 and g.run_bytes == n
        and verified(verify, t, c)
        and int(t.crc_offset[c]) == runs.file_offset + n
        and (t.flags is None or not t.flags[c])
    )  # fmt: skip


def merge_whole_chunks(tasks: list[ReadTask], verify: bool) -> list[ReadTask | ChunkRun]:
    """The reads with whole one-block chunks that follow each other in a file merged into
    ChunkRuns of up to _JOB_BYTES (after the other reads, which stay in their order): a
    restore of many small arrays would otherwise make a request, and pay Python's cost of
    a read, per chunk."""
    out: list[ReadTask | ChunkRun] = []
    whole: list[ReadTask] = []
    for t in tasks:
        (whole if _whole_chunk(t, verify) else out).append(t)
    whole.sort(key=lambda t: (t.runs.file, t.runs.file_offset))
    run: ChunkRun | None = None
    for t in whole:
        n = t.rng.stop + 4  # the chunk and its checksum
        last = run.tasks[-1].runs if run is not None else None
        if (
            run is not None and last is not None
            and last.file == t.runs.file
            and last.file_offset + int(last.table.nbytes[last.chunk]) + 4 == t.runs.file_offset
            and run.nbytes + n <= _JOB_BYTES
        ):  # fmt: skip
            run.tasks.append(t)
            run.nbytes += n
        else:
            run = ChunkRun([t], n)
            out.append(run)
    return out


def _size(unit: ReadTask | ChunkRun) -> int:
    return unit.nbytes if isinstance(unit, ChunkRun) else unit.rng.stop - unit.rng.start


def jobs(units: list[ReadTask | ChunkRun], threads: int) -> list[list[ReadTask | ChunkRun]]:
    """Consecutive reads (largest first) grouped into the read threads' jobs: a large read
    alone, small ones together up to _JOB_BYTES, and at least _JOBS_PER_THREAD jobs per
    thread where there are reads enough, so that the threads still share the work evenly.
    A restore of many small arrays would otherwise pay the pool's submit and lock per read,
    more than the read itself."""
    sizes = [_size(u) for u in units]
    limit = max(1, min(_JOB_BYTES, sum(sizes) // (threads * _JOBS_PER_THREAD)))
    out: list[list[ReadTask | ChunkRun]] = []
    held = limit
    for t, n in zip(units, sizes, strict=True):
        if held + n > limit:
            out.append([])
            held = 0
        out[-1].append(t)
        held += n
    return out
