"""The read plan: which byte ranges of which chunks fill a batch's host buffers.

Pure functions over the chunk tables and the destination boxes; no I/O. Each destination
box is checked to be tiled exactly once by the chunks overlapping it. A box that is
exactly a whole one-block chunk (an array restored onto its saved layout) is planned in
bulk: such chunks lying back to back in a file become `ChunkRun`s, one read each, built
from columns with no object per chunk. Every other overlap becomes a `RunGrid`
(planning/overlaps.py); the grids of one chunk become its reads (`ReadTask`), coalesced per
checksum block (verified) or within `max_gap` (unverified). `jobs` groups the reads for the
read threads. The reads themselves are done by reads.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from ..dtypes import dtype_from_name
from ..errors import CorruptCheckpointError
from ..format import ArrayLeaf, ChunkTable, FileEntry
from ..format.binding import chunk_keys
from ..format.validate import coverage_problems
from ..planning import ChunkIndex, ReadRange, RunGrid, coalesce_runs, run_grid, whole_grid
from ..planning.overlaps import covering_range
from .buffers import Dest, ReadStats


class SortedRuns(NamedTuple):
    src: np.ndarray  # run offsets in the chunk
    length: np.ndarray
    dest: np.ndarray  # index into the batch's dest list
    dst: np.ndarray  # run offsets in the destination buffer
    overlap: np.ndarray  # index into `grids`


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
    def sorted(self) -> SortedRuns:
        expanded = [g.runs() for _, g in self.grids]
        sizes = [g.count for _, g in self.grids]
        src = np.concatenate([e[0] for e in expanded])
        order = np.argsort(src, kind="stable")
        return SortedRuns(
            src[order],
            np.repeat(np.array([g.run_bytes for _, g in self.grids], np.int64), sizes)[order],
            np.repeat(np.array([di for di, _ in self.grids], np.int64), sizes)[order],
            np.concatenate([e[1] for e in expanded])[order],
            np.repeat(np.arange(len(self.grids)), sizes)[order],
        )


@dataclass
class ReadTask:
    """One contiguous read of a chunk."""

    runs: ChunkRuns
    rng: ReadRange

    @property
    def file(self) -> str:
        return self.runs.file

    @property
    def file_start(self) -> int:  # where the read starts in its file
        return self.runs.file_offset + self.rng.start

    @property
    def size(self) -> int:
        return self.rng.stop - self.rng.start

    @property
    def hintable(self) -> bool:
        """Whether the read is a range of its file as stored (not of a compressed chunk's
        decoded bytes): what a prefetch may ask the storage for."""
        t = self.runs.table
        return t.flags is None or not t.flags[self.runs.chunk]


@dataclass
class ChunkRun:
    """Whole chunks of one checksum block each, lying back to back in one file, each
    followed by its checksum: read with one request straight into their destinations (each
    chunk is one whole destination buffer), then checked chunk by chunk. Columns, one entry
    per chunk, in file order."""

    file: str
    file_start: int  # where the first chunk starts in the file
    size: int  # bytes in the file, checksums included
    dest: np.ndarray  # index into the batch's dest list
    nbytes: np.ndarray  # bytes of each chunk
    keys: np.ndarray  # what each chunk's stored checksum is XORed with (format.binding)
    chunk: np.ndarray  # the chunk's number in its leaf's table (for errors)
    verify: bool
    hintable = True


ReadUnit = ReadTask | ChunkRun


# Overlaps that need this much of the span they cover are read as that one span.
_DENSE = 0.98

# Small reads are handed to the read threads in jobs of up to this many bytes (`jobs`).
JOB_BYTES = 1 << 20
_JOBS_PER_THREAD = 4


def verified(verify: bool, t: ChunkTable, c: int) -> bool:
    """Chunks with checksum block size 0 have no checksums (tables of other formats)."""
    return verify and int(t.block[c]) > 0


def _covered(
    index: ChunkIndex, t: ChunkTable, d: Dest, url: str, seen: dict[Any, tuple[int, np.ndarray]]
) -> tuple[int, np.ndarray]:
    """The chunk whose box is exactly dest `d`'s (-1: none) and the chunks overlapping it,
    after checking that they tile its box exactly once (the planner guarantees it for what
    snapshard writes; a damaged checkpoint may not). Arrays sharing their chunk boxes share
    the answer (`seen`, keyed by the objects: dests of arrays alike share their box arrays,
    and every key's objects live as long as the plan)."""
    key = (id(index), id(d.start), id(d.stop))
    done = seen.get(key)
    if done is None:
        exact = index.exact(d.start, d.stop) if t.stores_own_boxes else -1
        done = seen[key] = (exact, _check_cover(index, t, d, exact, url))
    return done


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


def plan_reads(
    files: Sequence[FileEntry],
    dests: list[Dest],
    tables: dict[int, ChunkTable],
    verify: bool,
    max_gap: int,
    stats: ReadStats,
    url: str = "",
) -> list[ReadUnit]:
    """The reads that fill `dests` from the chunks of `tables` (`files`: the checkpoint's
    file list, by the tables' file numbers), each checked to be covered exactly once: the
    runs of whole chunks first, then the other reads."""
    whole, per_chunk, leaves = _overlaps(dests, tables, stats, url)
    units: list[ReadUnit] = list(_chunk_runs(whole, files, verify, stats))
    for (key, c), grids in per_chunk.items():
        leaf = leaves[key]
        t = tables[key]
        block = int(t.block[c]) if verified(verify, t, c) else None
        runs = ChunkRuns(leaf, t, c, files[int(t.file[c])].name, int(t.offset[c]), grids)
        stats.chunks_touched += 1
        for r in _chunk_ranges(runs, grids, int(t.nbytes[c]), block, max_gap):
            stats.bytes_read += r.stop - r.start
            stats.reads += 1
            units.append(ReadTask(runs, r))
    return units


class _WholeChunks:
    """Destination boxes that are exactly one whole chunk each, as columns (see ChunkRun).

    A chunk qualifies when it is one checksum block, uncompressed, its checksum right after
    it (what a save writes for small chunks), and fills the destination. `add` takes the
    candidates; `settle` decides them all at once, from the tables their tables are rows of
    (ChunkTable.rows_of): a restore of many small arrays would otherwise pay NumPy's cost
    per call per chunk."""

    def __init__(self) -> None:
        # by id of the source table: (it, dest indices, rows in it, dest bytes, chunks)
        self._candidates: dict[
            int, tuple[ChunkTable, list[int], list[int], list[int], list[int]]
        ] = {}
        self.dest = self.file = self.offset = self.nbytes = self.chunk = np.zeros(0, np.int64)
        self.keys = np.zeros(0, np.int64)  # of the chunk's file, where checksums are bound
        self.bound = np.zeros(0, bool)

    def add(self, di: int, d: Dest, t: ChunkTable, c: int) -> None:
        """Dest `di` (`d`) is exactly chunk `c` of `t`: a candidate."""
        source, at = t.rows_of or (t, 0)
        got = self._candidates.get(id(source))
        if got is None:
            got = self._candidates[id(source)] = (source, [], [], [], [])
        got[1].append(di)
        got[2].append(at + c)
        got[3].append(d.buf.nbytes)
        got[4].append(c)

    def settle(self) -> list[tuple[int, int]]:
        """Keep the candidates that qualify, as columns; the others as (dest index, chunk)."""
        cols: list[list[np.ndarray]] = [[] for _ in range(7)]
        rejected: list[tuple[int, int]] = []
        for t, dis, rows, sizes, chunks in self._candidates.values():
            r = np.asarray(rows, np.int64)
            di, c = np.asarray(dis, np.int64), np.asarray(chunks, np.int64)
            if t.crc_offset is None:
                ok = np.zeros(len(r), bool)
            else:
                offset, n = t.offset[r], t.nbytes[r]
                ok = (n > 0) & (n <= t.block[r]) & (t.crc_offset[r] == offset + n)
                ok &= np.asarray(sizes, np.int64) == n
                if t.flags is not None:
                    ok &= t.flags[r] == 0
            rejected.extend(zip(di[~ok].tolist(), c[~ok].tolist(), strict=True))
            r = r[ok]
            file = t.file[r]
            key = np.zeros(len(r), np.int64) if t.file_keys is None else t.file_keys[file]
            for k, col in enumerate((di[ok], file, t.offset[r], t.nbytes[r], c[ok], key)):
                cols[k].append(col)
            cols[6].append(np.full(len(r), t.file_keys is not None))
        self._candidates.clear()
        if cols[0]:
            joined = [np.concatenate(c) for c in cols]
            self.dest, self.file, self.offset, self.nbytes, self.chunk, self.keys = (
                x.astype(np.int64) for x in joined[:6]
            )
            self.bound = joined[6]
        return rejected


_Overlaps = dict[tuple[int, int], list[tuple[int, RunGrid]]]


def _overlaps(
    dests: list[Dest], tables: dict[int, ChunkTable], stats: ReadStats, url: str
) -> tuple[_WholeChunks, _Overlaps, dict[int, ArrayLeaf]]:
    """The dests that are whole chunks; per (leaf, chunk) of the others: the dests it
    overlaps, each with the grid of runs the overlap is made of; and the leaves by id."""
    # Arrays with the same chunk boxes share their box columns (interned when the manifest is
    # read), hence one index.
    indexes: dict[int, ChunkIndex] = {}
    covered: dict[Any, tuple[int, np.ndarray]] = {}
    grid_cache: dict[Any, RunGrid] = {}  # overlaps of arrays with equal boxes are equal
    whole = _WholeChunks()
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
        exact, over = _covered(index, t, d, url, covered)
        if exact >= 0:  # the box is a chunk: one run, the whole of both
            whole.add(di, d, t, exact)
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
    for di, c in whole.settle():  # whole chunks read as any other (several blocks, ...)
        d = dests[di]
        per_chunk.setdefault((id(d.leaf), c), []).append((di, whole_grid(d.buf.nbytes)))
    return whole, per_chunk, leaves


def _chunk_runs(
    whole: _WholeChunks, files: Sequence[FileEntry], verify: bool, stats: ReadStats
) -> list[ChunkRun]:
    """The whole chunks in file order, cut into ChunkRuns where the next chunk does not
    follow the last one's checksum or the run would pass JOB_BYTES: a restore of many
    small arrays would otherwise pay Python's cost of a read per chunk."""
    n = len(whole.dest)
    if not n:
        return []
    order = np.lexsort((whole.offset, whole.file))
    file, offset, nbytes = whole.file[order], whole.offset[order], whole.nbytes[order]
    dest, chunk, bound = whole.dest[order], whole.chunk[order], whole.bound[order]
    keys = np.where(bound, chunk_keys(whole.keys[order], offset), 0)
    stats.chunks_touched += n
    stats.bytes_read += int(nbytes.sum())  # (the checksums after them not counted, as elsewhere)
    starts = run_starts(file, offset, nbytes)
    out = []
    for a, b in zip(starts.tolist(), [*starts[1:].tolist(), n], strict=True):
        size = int(offset[b - 1] + nbytes[b - 1] + 4 - offset[a])
        out.append(ChunkRun(
            files[int(file[a])].name, int(offset[a]), size, dest[a:b], nbytes[a:b], keys[a:b],
            chunk[a:b], verify,
        ))  # fmt: skip
    stats.reads += len(out)
    return out


def run_starts(file: np.ndarray, offset: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Where runs start among chunks sorted by (file, offset): at a new file, at a gap, and
    within a stretch of chunks back to back each time it passes another JOB_BYTES."""
    ends = offset + nbytes + 4  # each chunk and its checksum
    breaks = np.ones(len(file), bool)
    breaks[1:] = (file[1:] != file[:-1]) | (offset[1:] != ends[:-1])
    stretch = np.cumsum(breaks) - 1
    bucket = (ends - offset[np.flatnonzero(breaks)][stretch] - 1) // JOB_BYTES
    breaks[1:] |= bucket[1:] != bucket[:-1]
    return np.flatnonzero(breaks)


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
    return coalesce_runs(runs.sorted.src, runs.sorted.length, nbytes, block=block, max_gap=max_gap)


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


def jobs(units: list[ReadUnit], threads: int) -> list[list[ReadUnit]]:
    """Consecutive reads (largest first) grouped into the read threads' jobs: a large read
    alone, small ones together up to JOB_BYTES, and at least _JOBS_PER_THREAD jobs per
    thread where there are reads enough, so that the threads still share the work evenly.
    A restore of many small arrays would otherwise pay the pool's submit and lock per read,
    more than the read itself."""
    sizes = [u.size for u in units]
    limit = max(1, min(JOB_BYTES, sum(sizes) // (threads * _JOBS_PER_THREAD)))
    out: list[list[ReadUnit]] = []
    held = limit
    for t, n in zip(units, sizes, strict=True):
        if held + n > limit:
            out.append([])
            held = 0
        out[-1].append(t)
        held += n
    return out
