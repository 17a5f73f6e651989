"""The read executor: read exactly the bytes each process needs and build its arrays.

For every target box this process holds (replicated boxes once), the overlapping chunks are
found through an index, the overlaps become byte runs, runs are coalesced into reads, and
each read scatters straight into preallocated, aligned host buffers (preadv). With
verification on (the default), every checksum block a read touches is read whole and
checked. Buffers become jax.Arrays with make_array_from_callback; on the CPU
backend the first device of a box takes the buffer without a copy.

The internal API of every reader in the package (snapshard.load, Orbax and safetensors
sources, the torch adapter, read-once): `make_request` says what to build for a leaf,
`execute` reads and builds requests in memory-bounded batches through a `ReadDests`, and
`reader_of` is the `ReadDests` of a snapshard checkpoint. Call order: make_request for each
leaf → execute(requests, reader) → values in request order.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Any, TypeVar

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .adapters.loaded import is_jax_array, is_prng_key_dtype, is_shape_dtype_struct
from .checksum import BlockVerifier, crc32c
from .dtypes import dtype_from_name
from .errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    TargetMismatchError,
)
from .format import ArrayLeaf, ChunkTable, FileEntry, Manifest
from .format.finder import ChunkFinder, loaded_table
from .format.kinds import LeafKind
from .format.validate import coverage_problems
from .options import ReadOptions
from .planning import ChunkIndex, ReadRange, RunGrid, coalesce_runs, run_grid, whole_grid
from .planning.read_plan import covering_range
from .storage import Storage

_ALIGN = 64


@dataclass
class ReadStats:
    """What a load read on this process. bytes_needed counts each box read once (with
    read-once, this process's share of the replicated leaves); bytes_from_peers counts the
    bytes of this process's target boxes that other processes read and sent."""

    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_from_peers: int = 0
    metadata_bytes: int = 0  # chunk records read (v2), beside the manifest
    reads: int = 0
    chunks_touched: int = 0
    read_s: float = 0.0
    assemble_s: float = 0.0
    reshard_s: float = 0.0  # read-once: moving the bytes read onto the target shardings
    total_s: float = 0.0

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(self.__dict__)
        d["read_amplification"] = self.read_amplification
        return d


def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer whose data pointer is 64-byte aligned (lets XLA's CPU client alias it)."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off : off + nbytes]


@dataclass
class Dest:
    """One host buffer to fill: box [start, stop) of a saved array."""

    leaf: ArrayLeaf
    start: np.ndarray
    stop: np.ndarray
    buf: np.ndarray
    devices: tuple[Any, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.stop - self.start)


@dataclass
class Request:
    """One leaf to produce. kind: 'numpy', 'scalar', 'jax', 'key' (typed PRNG key)."""

    saved: ArrayLeaf
    kind: str
    dtype: np.dtype
    sharding: Any = None
    dests: list[Dest] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(d.buf.nbytes for d in self.dests)


def make_request(saved: ArrayLeaf, target: Any, url: str, mesh: Any = None) -> Request:
    """What to build for a saved array leaf given its target leaf (None: NumPy as saved)."""
    name = saved.name
    saved_dtype = dtype_from_name(saved.dtype)
    if target is None:
        if saved.kind == LeafKind.PRNG_KEY:
            return request_boxes(Request(saved, "key", saved_dtype), None)
        kind = "scalar" if saved.kind == LeafKind.SCALAR else "numpy"
        return request_boxes(Request(saved, kind, saved_dtype), None)
    if is_jax_array(target) or is_shape_dtype_struct(target):
        from .adapters.jax_arrays import resolve_target_sharding

        shape, dtype = tuple(target.shape), target.dtype
        sharding = resolve_target_sharding(getattr(target, "sharding", None), mesh, leaf=name)
    elif isinstance(target, np.ndarray | np.generic):
        shape, dtype, sharding = tuple(np.shape(target)), target.dtype, None
    else:
        raise TargetMismatchError(
            f"{url}: target for leaf {name!r} is a {type(target).__name__}; expected jax.Array, "
            "jax.ShapeDtypeStruct or np.ndarray"
        )
    wants_key = is_prng_key_dtype(dtype)
    if wants_key and saved.kind != LeafKind.PRNG_KEY:
        raise TargetMismatchError(
            f"{url}: leaf {name!r} was saved as {saved.dtype} data, the target asks for PRNG keys"
        )
    expected = saved.logical_shape if wants_key else saved.shape
    if shape != expected:
        raise TargetMismatchError(
            f"{url}: leaf {name!r} has shape {expected} in the checkpoint, the target asks for {shape}"
        )
    if wants_key:
        return request_boxes(Request(saved, "key", saved_dtype, sharding), None)
    out_dtype = np.dtype(dtype)
    if sharding is None:
        kind = "scalar" if isinstance(target, np.generic) else "numpy"
        return request_boxes(Request(saved, kind, out_dtype), None)
    return request_boxes(Request(saved, "jax", out_dtype, sharding), sharding)


def request_boxes(req: Request, sharding: Any) -> Request:
    shape = req.saved.shape
    itemsize = dtype_from_name(req.saved.dtype).itemsize
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]]
    if sharding is None:
        boxes = [(tuple(0 for _ in shape), shape, ())]
    else:
        from .adapters.jax_arrays import local_device_boxes

        boxes = local_device_boxes(sharding, shape)
    sizes = [math.prod(b - a for a, b in zip(s, e, strict=True)) * itemsize for s, e, _ in boxes]
    # One allocation per leaf, cut at 64-byte aligned offsets: a buffer per box would cost
    # an allocation per shard.
    offsets = [0, *accumulate(-(-n // _ALIGN) * _ALIGN for n in sizes)]
    whole = aligned_empty(offsets[-1])
    for (start, stop, devices), at, nbytes in zip(boxes, offsets[:-1], sizes, strict=True):
        s, e = np.asarray(start, dtype=np.int64), np.asarray(stop, dtype=np.int64)
        req.dests.append(Dest(req.saved, s, e, whole[at : at + nbytes], devices))
    return req


@dataclass
class _ChunkRuns:
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
class _Task:
    """One contiguous read of a chunk."""

    runs: _ChunkRuns
    rng: ReadRange


# Overlaps that need this much of the span they cover are read as that one span.
_DENSE = 0.98
# A read with more pieces than this goes through one contiguous scratch buffer and strided
# copies, rather than an iovec per piece (Python cost per piece beats the extra memcpy).
_MAX_SCATTER_PIECES = 64
# Where the storage reads cheaply in pieces, such a read goes through windows of at least
# this many bytes: the per-window work is small beside the copies, and a window stays in
# the CPU's cache between the read and the copies.
_WINDOW_BYTES = 1 << 20
# Small reads are handed to the read threads in jobs of up to this many bytes (`_jobs`).
_JOB_BYTES = 1 << 20
_JOBS_PER_THREAD = 4
# The largest reads of a restore probed for whether its bytes are in memory (`_cached`).
_PROBED_READS = 8
# How far a restore from the device asks for bytes ahead of its reads (`_Prefetch`).
# Evicted 2 GiB restores, 4 threads, fresh processes: 1.30 s at 64 MiB, 1.28-1.31 s at 16-32
# MiB, 1.35-1.45 s at 128-256 MiB, 1.85 s at 512 MiB, 1.85-2.05 s without (medians of 6).
_PREFETCH_BYTES = 64 << 20


def _verified(verify: bool, t: ChunkTable, c: int) -> bool:
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
) -> list[_Task]:
    """The reads that fill `dests` from the chunks of `tables` (`files`: the checkpoint's
    file list, by the tables' file numbers), each checked to be covered exactly once."""
    per_chunk, leaves = _overlaps(dests, tables, stats, url)
    tasks = []
    for (key, c), grids in per_chunk.items():
        leaf = leaves[key]
        t = tables[key]
        block = int(t.block[c]) if _verified(verify, t, c) else None
        runs = _ChunkRuns(leaf, t, c, files[int(t.file[c])].name, int(t.offset[c]), grids)
        stats.chunks_touched += 1
        for r in _chunk_ranges(runs, grids, int(t.nbytes[c]), block, max_gap):
            stats.bytes_read += r.stop - r.start
            stats.reads += 1
            tasks.append(_Task(runs, r))
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
    runs: _ChunkRuns,
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


def _scatter_views(task: _Task, dests: list[Dest]) -> list[memoryview]:
    """The range as iovecs: destination pieces, with scratch for the bytes between them."""
    r = task.rng
    bufs: list[memoryview] = []
    gaps: list[tuple[int, int]] = []  # (position in bufs, size)
    pos = r.start
    for di, s, off, n in _pieces_of(task):
        if s > pos:
            gaps.append((len(bufs), s - pos))
            bufs.append(memoryview(b""))
        bufs.append(dests[di].buf.data[off : off + n])
        pos = s + n
    if pos < r.stop:
        gaps.append((len(bufs), r.stop - pos))
        bufs.append(memoryview(b""))
    if gaps:
        scratch = np.empty(sum(n for _, n in gaps), dtype=np.uint8).data
        at = 0
        for i, n in gaps:
            bufs[i] = scratch[at : at + n]
            at += n
    return bufs


def _pieces_of(task: _Task) -> Iterable[tuple[int, int, int, int]]:
    """(dest index, offset in the chunk, offset in the dest, length) of each run of a range,
    in chunk order. The one run of a chunk's only overlap (a box restored onto the saved
    layout) needs no per-run arrays: building them would cost more than its read."""
    runs, r = task.runs, task.rng
    if len(runs.grids) == 1 and runs.grids[0][1].count == 1:
        di, g = runs.grids[0]
        return [(di, g.src_base, g.dst_base, g.run_bytes)]
    src, dst, length, dest = runs.src, runs.dst, runs.length, runs.dest
    return ((int(dest[p]), int(src[p]), int(dst[p]), int(length[p])) for p in range(r.p0, r.p1))


def _copy_from_scratch(task: _Task, scratch: np.ndarray, dests: list[Dest]) -> None:
    """Copy the runs of a range read into `scratch` to their destinations: whole overlaps
    as one strided NumPy copy each, runs of overlaps split across ranges one by one."""
    runs, r = task.runs, task.rng
    total = sum(g.count for _, g in runs.grids)
    if r.p1 - r.p0 == total:  # every overlap of the chunk, whole: no per-run arrays needed
        ids, counts = list(range(len(runs.grids))), [g.count for _, g in runs.grids]
    else:
        inside = runs.overlap[r.p0 : r.p1]
        unique, n_inside = np.unique(inside, return_counts=True)
        ids, counts = unique.tolist(), n_inside.tolist()
    for ov, n in zip(ids, counts, strict=True):
        di, g = runs.grids[ov]
        dest = dests[di].buf
        if n == g.count:
            src = as_strided(
                scratch[g.src_base - r.start :],
                (*g.outer_shape, g.run_bytes),
                (*g.src_strides, 1),
                writeable=False,
            )
            dst = as_strided(dest[g.dst_base :], (*g.outer_shape, g.run_bytes), (*g.dst_strides, 1))
            np.copyto(dst, src)
            continue
        for p in np.flatnonzero(runs.overlap[r.p0 : r.p1] == ov) + r.p0:
            a, b, ln = int(runs.src[p]) - r.start, int(runs.dst[p]), int(runs.length[p])
            dest[b : b + ln] = scratch[a : a + ln]


def _pieces(bufs: list[memoryview], size: int) -> list[list[memoryview]]:
    """`bufs` cut into consecutive groups of `size` bytes (the last one shorter)."""
    out: list[list[memoryview]] = []
    cur: list[memoryview] = []
    n = 0
    for b in bufs:
        while len(b):
            take = min(len(b), size - n)
            cur.append(b[:take])
            b = b[take:]
            n += take
            if n == size:
                out.append(cur)
                cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def _piece_bytes(storage: Storage, task: _Task) -> int | None:
    """The size of the pieces a range is read in, one at a time (None: one read).

    Where the storage reads cheaply in pieces (local files), a range is read a few checksum
    blocks at a time, each piece handled right after it lands, while it is still in cache:
    one pass over memory instead of two. Bytes that must come from the device are read in
    larger pieces (`Storage.cold_read_piece_bytes`), which the device streams faster."""
    runs, r = task.runs, task.rng
    piece = storage.read_piece_bytes
    if piece is None or r.stop - r.start <= 2 * piece:
        return None
    cold = storage.cold_read_piece_bytes
    # The range's last byte is read last: if even it is cached, the range is.
    if cold is not None and storage.in_memory(runs.file, runs.file_offset + r.stop - 1) is False:
        piece = cold
    block = int(runs.table.block[runs.chunk])
    return max(block, piece // block * block) if block else piece


def _block_span(task: _Task) -> tuple[int, int, int]:
    """(checksum block size, first block, one past the last block) of a task's range."""
    block = int(task.runs.table.block[task.runs.chunk])
    return block, task.rng.start // block, -(-task.rng.stop // block)


class _RangeReads:
    """The reads of one range of an uncompressed chunk, front to back, each piece checked
    against the chunk's checksum blocks as it lands (with `checked`; `crc_bytes`: the v2
    checksums of the range's blocks, when already read)."""

    def __init__(
        self, storage: Storage, task: _Task, checked: bool, crc_bytes: np.ndarray | None = None
    ) -> None:
        self.storage, self.runs = storage, task.runs
        self.at = task.rng.start  # the next byte to read, in the chunk
        self.verifier = self._verifier(task, crc_bytes) if checked else None

    def _verifier(self, task: _Task, crc_bytes: np.ndarray | None) -> BlockVerifier:
        t, c, r = self.runs.table, self.runs.chunk, task.rng
        block, b0, b1 = _block_span(task)
        if t.crc_offset is None:  # v1: the checksums are in the index
            crcs = t.block_crcs(c).tolist()
        else:  # v2: the checksums of the blocks read lie in the file
            if crc_bytes is None:
                crc_bytes = np.empty(4 * (b1 - b0), np.uint8)
                at = int(t.crc_offset[c]) + 4 * b0
                self.storage.read_into(self.runs.file, at, [crc_bytes.data])
            key = t.key(c)  # 2.1: the stored checksums are bound to file and offset
            crcs = [0] * b0 + (crc_bytes.view("<u4") ^ np.uint32(key)).tolist()
        return BlockVerifier(crcs, b0, block, r.stop - r.start)

    def read(self, views: list[memoryview]) -> None:
        """Read the next bytes into `views` (and check them)."""
        self.storage.read_into(self.runs.file, self.runs.file_offset + self.at, views)
        self.at += sum(len(x) for x in views)
        self.check(views)

    def check(self, views: list[memoryview]) -> None:
        v = self.verifier
        if v is None:
            return
        for x in views:
            v.update(x)
        if v.mismatch is not None:
            blk, want, got = v.mismatch
            raise ChecksumMismatchError(
                file=f"{self.storage.url}/{self.runs.file}",
                leaf=self.runs.leaf.name,
                chunk=self.runs.chunk,
                block=blk,
                expected=want,
                actual=got,
            )


def _read_verified(
    storage: Storage, task: _Task, bufs: list[memoryview], piece: int | None
) -> None:
    """Read a range of an uncompressed chunk into `bufs` and check its checksum blocks:
    piece by piece (`_piece_bytes`), or in one read, which for a range ending at the end of
    a v2 chunk also brings the checksums that follow it."""
    runs, r = task.runs, task.rng
    t, c = runs.table, runs.chunk
    if piece is not None:
        reads = _RangeReads(storage, task, checked=True)
        for views in _pieces(bufs, piece):
            reads.read(views)
        return
    if t.crc_offset is not None:
        crc_at = int(t.crc_offset[c])
        if r.stop == int(t.nbytes[c]) and crc_at == int(t.offset[c]) + r.stop:
            _, b0, b1 = _block_span(task)
            raw, skip = np.empty(4 * (b1 - b0), np.uint8), np.empty(4 * b0, np.uint8)
            storage.read_into(runs.file, runs.file_offset + r.start, [*bufs, skip.data, raw.data])
            _RangeReads(storage, task, True, raw).check(bufs)
            return
    _RangeReads(storage, task, checked=True).read(bufs)


def _row_windows(task: _Task) -> list[tuple[int, RunGrid]] | None:
    """The overlaps a scratch read holds when it can copy them out window by window: each
    whole in the range and with rows (its first axis). None: read the whole range, then
    copy."""
    runs, r = task.runs, task.rng
    if r.p1 - r.p0 == sum(g.count for _, g in runs.grids):
        grids = runs.grids
    else:
        inside, n = np.unique(runs.overlap[r.p0 : r.p1], return_counts=True)
        grids = [runs.grids[k] for k in inside.tolist()]
        if any(g.count != m for (_, g), m in zip(grids, n.tolist(), strict=True)):
            return None
    if any(not g.outer_shape for _, g in grids):
        return None
    return grids


def _window_bytes(grids: list[tuple[int, RunGrid]], piece: int, block: int) -> int | None:
    """The window of a windowed read: at least _WINDOW_BYTES, the read's piece and its
    longest row, in whole checksum blocks (so that a window's rows are copied out only
    once every block under them is checked). None: window and carried row together
    beyond the scratch reuse limit (read the whole range instead)."""
    longest = max(_row_extent(g) for _, g in grids)
    window = max(piece, _WINDOW_BYTES, longest)
    if block:
        window = -(-window // block) * block
    return window if window + longest <= _SCRATCH_REUSE_BYTES else None


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


def _read_windowed(
    storage: Storage, task: _Task, grids: list[tuple[int, RunGrid]], dests: list[Dest],
    window: int, checked: bool,
) -> None:  # fmt: skip
    """Read a range `window` bytes at a time into a small scratch buffer, copying out every
    row of every overlap as soon as it is complete: the scratch stays in cache, and the
    bytes of a row cut by a window's end move to the buffer's front for the next one
    (fewer than a window: `_window_bytes` makes windows at least a row long)."""
    r = task.rng
    reads = _RangeReads(storage, task, checked)
    extents = [_row_extent(g) for _, g in grids]
    buf = _scratch_buffer(window + max(extents))
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


_scratch = threading.local()
_SCRATCH_REUSE_BYTES = 64 << 20


def _scratch_buffer(nbytes: int) -> np.ndarray:
    """A read thread's scratch buffer of `nbytes`, reused from task to task within one read
    (fresh memory costs a page fault per page; on a VM, much more) up to
    _SCRATCH_REUSE_BYTES."""
    if nbytes > _SCRATCH_REUSE_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    buf: np.ndarray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _scratch.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def _run_task(storage: Storage, task: _Task, dests: list[Dest], verify: bool) -> None:
    runs, r = task.runs, task.rng
    t, c = runs.table, runs.chunk
    checked = _verified(verify, t, c)
    compressed = t.flags is not None and bool(t.flags[c])  # blocks of snapshard.codecs
    scratch = None
    piece = None
    if r.p1 - r.p0 > _MAX_SCATTER_PIECES:
        piece = None if compressed else _piece_bytes(storage, task)
        grids = None if piece is None else _row_windows(task)
        if grids is not None and piece is not None:
            window = _window_bytes(grids, piece, int(t.block[c]))
            if window is not None:
                _read_windowed(storage, task, grids, dests, window, checked)
                return
        scratch = _scratch_buffer(r.stop - r.start)
        bufs = [scratch.data]
    else:
        bufs = _scatter_views(task, dests)
        if checked and not compressed:
            piece = _piece_bytes(storage, task)
    if compressed:
        _read_compressed(storage, task, bufs, checked)
    elif not checked:
        storage.read_into(runs.file, runs.file_offset + r.start, bufs)
    else:
        _read_verified(storage, task, bufs, piece)
    if scratch is not None:
        _copy_from_scratch(task, scratch, dests)


def _read_compressed(storage: Storage, task: _Task, bufs: list[memoryview], verify: bool) -> None:
    from .codecs import codec_of, read_range

    runs, r = task.runs, task.rng
    t, c = runs.table, runs.chunk
    assert t.flags is not None and t.crc_offset is not None
    read_range(
        storage, runs.file, offset=int(t.offset[c]), nbytes=int(t.nbytes[c]),
        block=int(t.block[c]), crc_offset=int(t.crc_offset[c]), codec=codec_of(int(t.flags[c])),
        itemsize=dtype_from_name(runs.leaf.dtype).itemsize, start=r.start, stop=r.stop,
        buffers=bufs, verify=verify, key=t.key(c), leaf=runs.leaf.name, chunk=c,
    )  # fmt: skip


def build(req: Request) -> Any:
    """The value a request asks for (NumPy, scalar, typed keys or a jax.Array) from its
    filled host buffers."""
    saved_dtype = dtype_from_name(req.saved.dtype)

    def host(d: Dest, dtype: np.dtype) -> np.ndarray:
        a = d.buf.view(saved_dtype).reshape(d.shape)
        return a if dtype == saved_dtype else a.astype(dtype)

    if req.kind in ("numpy", "scalar"):
        a = host(req.dests[0], req.dtype)
        return a[()] if req.kind == "scalar" else a
    from .adapters.jax_arrays import array_from_host_boxes, key_array  # keys, jax.Arrays

    if req.kind == "key":
        # Key arrays are small: every process reads all of the key data and builds its part.
        impl = req.saved.key_impl
        data = host(req.dests[0], saved_dtype)
        return key_array(data, impl, req.sharding)
    boxes = [
        (tuple(d.start.tolist()), tuple(d.stop.tolist()), host(d, req.dtype), d.devices)
        for d in req.dests
    ]
    return array_from_host_boxes(req.saved.shape, req.sharding, boxes)


# The boxes the processes that saved an array held, as (n, ndim) starts and stops (None:
# unknown); read-once restores take it to tell whether a target cuts the saved rows.
SavedBoxes = Callable[[ArrayLeaf], tuple[np.ndarray, np.ndarray] | None]


def saved_boxes(manifest: Manifest, leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
    """The boxes the processes that saved `leaf` held: from its layout (v2), else its
    chunks (v1, safetensors files; None: not known without reading records)."""
    if manifest.version >= 2 and leaf.layout is not None:
        if manifest.finder is None:
            return None
        groups = manifest.finder.holders(leaf).groups
        return groups.starts, groups.stops
    return chunk_boxes(leaf)


def chunk_boxes(leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
    """The boxes of the chunk table a leaf holds in memory (None: it has none)."""
    t = leaf.chunks
    return (t.starts, t.stops) if len(t) else None


def chunk_tables(
    finder: ChunkFinder | None, dests: list[Dest], stats: ReadStats
) -> dict[int, ChunkTable]:
    """The chunk table of every leaf the dests belong to: from the manifest (v1, other
    formats, or a v2 table already fetched), else only the records the dests need (v2)."""
    tables: dict[int, ChunkTable] = {}
    wants: dict[int, tuple[ArrayLeaf, list[tuple[np.ndarray, np.ndarray]]]] = {}
    for d in dests:
        if id(d.leaf) in tables:
            continue
        t = loaded_table(d.leaf) if finder is not None else d.leaf.chunks
        if t is not None:
            tables[id(d.leaf)] = t
        else:
            wants.setdefault(id(d.leaf), (d.leaf, []))[1].append((d.start, d.stop))
    if wants:
        assert finder is not None
        before = finder.metadata_bytes
        tables.update(finder.tables(list(wants.values())))
        stats.metadata_bytes += finder.metadata_bytes - before
    return tables


def _read_dests(
    storage: Storage,
    files: Sequence[FileEntry],
    finder: ChunkFinder | None,
    dests: list[Dest],
    verify: bool,
    threads: int | None,
    max_gap: int | None,
    stats: ReadStats,
) -> None:
    tables = chunk_tables(finder, dests, stats)
    gap = storage.read_gap_bytes if max_gap is None else max_gap
    tasks = plan_tasks(files, dests, tables, verify, gap, stats, storage.url)
    # Largest reads first keeps the threads busy to the end.
    tasks.sort(key=lambda t: -(t.rng.stop - t.rng.start))
    cached = _cached(storage, tasks)
    if threads is None:
        threads = storage.cached_read_threads() if cached is True else storage.read_threads
    ahead = _Prefetch(storage, tasks) if cached is False else None
    # (The prefetch follows the reads one by one, in order: with it, none are merged.)
    units: list[_Task | _ChunkRun] = [*tasks] if ahead else _merge_whole_chunks(tasks, verify)

    def run(job: list[_Task | _ChunkRun]) -> None:
        for u in job:
            if isinstance(u, _ChunkRun):
                _read_chunk_run(storage, u, dests)
                continue
            if ahead is not None:
                ahead.started()
            _run_task(storage, u, dests, verify)

    try:
        if threads > 1 and len(units) > 1:
            jobs = _jobs(units, threads)
            with ThreadPoolExecutor(
                min(threads, len(jobs)), thread_name_prefix="snapshard-read"
            ) as pool:
                for f in [pool.submit(run, job) for job in jobs]:
                    f.result()
        else:
            try:
                run(units)
            finally:  # the pool's threads end with the pool; this one lives on
                _scratch.__dict__.pop("buf", None)
    finally:
        if ahead is not None:
            ahead.stop()


@dataclass
class _ChunkRun:
    """Whole chunks of one checksum block lying back to back in one file, each followed by
    its checksum: read with one request, then checked chunk by chunk."""

    tasks: list[_Task]
    nbytes: int  # in the file, checksums included


def _whole_chunk(task: _Task, verify: bool) -> bool:
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
        and _verified(verify, t, c)
        and int(t.crc_offset[c]) == runs.file_offset + n
        and (t.flags is None or not t.flags[c])
    )  # fmt: skip


def _merge_whole_chunks(tasks: list[_Task], verify: bool) -> list[_Task | _ChunkRun]:
    """The reads with whole one-block chunks that follow each other in a file merged into
    _ChunkRuns of up to _JOB_BYTES (after the other reads, which stay in their order): a
    restore of many small arrays would otherwise make a request, and pay Python's cost of
    a read, per chunk."""
    out: list[_Task | _ChunkRun] = []
    whole: list[_Task] = []
    for t in tasks:
        (whole if _whole_chunk(t, verify) else out).append(t)
    whole.sort(key=lambda t: (t.runs.file, t.runs.file_offset))
    run: _ChunkRun | None = None
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
            run = _ChunkRun([t], n)
            out.append(run)
    return out


def _read_chunk_run(storage: Storage, run: _ChunkRun, dests: list[Dest]) -> None:
    """One request for a _ChunkRun's chunks and checksums, straight into the destinations,
    then each chunk checked against its checksum as `_RangeReads` would."""
    crc_bytes = np.empty(4 * len(run.tasks), np.uint8)
    bufs: list[memoryview] = []
    for i, t in enumerate(run.tasks):
        di, g = t.runs.grids[0]
        bufs.append(dests[di].buf.data[g.dst_base : g.dst_base + g.run_bytes])
        bufs.append(crc_bytes.data[4 * i : 4 * i + 4])
    first = run.tasks[0].runs
    storage.read_into(first.file, first.file_offset, bufs)
    stored = crc_bytes.view("<u4").tolist()
    for i, t in enumerate(run.tasks):
        expected = stored[i] ^ t.runs.table.key(t.runs.chunk)
        actual = crc32c(bufs[2 * i])
        if actual != expected:
            raise ChecksumMismatchError(
                file=f"{storage.url}/{t.runs.file}", leaf=t.runs.leaf.name, chunk=t.runs.chunk,
                block=0, expected=expected, actual=actual,
            )  # fmt: skip


def _size(unit: _Task | _ChunkRun) -> int:
    return unit.nbytes if isinstance(unit, _ChunkRun) else unit.rng.stop - unit.rng.start


def _jobs(units: list[_Task | _ChunkRun], threads: int) -> list[list[_Task | _ChunkRun]]:
    """Consecutive reads (largest first) grouped into the read threads' jobs: a large read
    alone, small ones together up to _JOB_BYTES, and at least _JOBS_PER_THREAD jobs per
    thread where there are reads enough, so that the threads still share the work evenly.
    A restore of many small arrays would otherwise pay the pool's submit and lock per read,
    more than the read itself."""
    sizes = [_size(u) for u in units]
    limit = max(1, min(_JOB_BYTES, sum(sizes) // (threads * _JOBS_PER_THREAD)))
    jobs: list[list[_Task | _ChunkRun]] = []
    held = limit
    for t, n in zip(units, sizes, strict=True):
        if held + n > limit:
            jobs.append([])
            held = 0
        jobs[-1].append(t)
        held += n
    return jobs


def _cached(storage: Storage, tasks: list[_Task]) -> bool | None:
    """Whether the bytes of a restore's largest reads are in memory (each range's last byte
    is read last: if even it is cached, the range is); None where the storage cannot tell
    or there are too few reads for it to matter."""
    if len(tasks) <= 1 or storage.cold_read_piece_bytes is None:
        return None
    probe = tasks[:_PROBED_READS]
    last = [storage.in_memory(t.runs.file, t.runs.file_offset + t.rng.stop - 1) for t in probe]
    if any(x is None for x in last):
        return None
    return all(last)


class _Prefetch:
    """Asks the storage to fetch the ranges of a restore whose bytes are on the device ahead
    of the read threads (`Storage.will_need`), in the order the threads take them, at most
    _PREFETCH_BYTES beyond the bytes of the reads started: the device always has work
    queued, also while the threads check and copy what they read. Call `started` as each
    read starts (in task order) and `stop` at the end."""

    def __init__(self, storage: Storage, tasks: list[_Task]) -> None:
        self.storage, self.tasks = storage, tasks
        self.cond = threading.Condition()
        self.begun = 0  # reads started
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="snapshard-prefetch")
        self.thread.start()

    def started(self) -> None:
        with self.cond:
            self.begun += 1
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join()

    def _run(self) -> None:
        sizes = [t.rng.stop - t.rng.start for t in self.tasks]
        starts = np.cumsum([0, *sizes]).tolist()  # bytes of the reads before each
        for i, t in enumerate(self.tasks):
            with self.cond:
                while not self.stopped and starts[i] - starts[self.begun] > _PREFETCH_BYTES:
                    self.cond.wait()
                if self.stopped:
                    return
                if i < self.begun:  # its read has started: the read fetches it
                    continue
            c = t.runs.chunk
            if t.runs.table.flags is not None and t.runs.table.flags[c]:
                continue  # compressed: the range is not a file range
            try:
                self.storage.will_need(t.runs.file, t.runs.file_offset + t.rng.start, sizes[i])
            except Exception:  # a hint: the reads report what is wrong
                return


T = TypeVar("T")


def batches(items: Sequence[T], size: Callable[[T], int], budget: int | None) -> list[list[T]]:
    """Consecutive items in batches of at most `budget` bytes by `size` (an item larger
    than the budget goes alone); budget None: one batch. Every restore path cuts its work
    with it, so that every process of a job cuts the same batches from the same sizes."""
    out: list[list[T]] = []
    cur: list[T] = []
    total = 0
    for it in items:
        n = size(it)
        if cur and budget is not None and total + n > budget:
            out.append(cur)
            cur, total = [], 0
        cur.append(it)
        total += n
    if cur:
        out.append(cur)
    return out


# Turns the destination buffers of a batch into the buffers actually read from storage, and
# the steps that fill the former from the latter once read (in order). Readers of other
# formats use it for arrays computed from stored ones (snapshard.safetensors transforms).
Expand = Callable[[list[Dest]], tuple[list[Dest], list[Callable[[], None]]]]


# Fills destination buffers from storage (the restore's reads, or another format's reader).
ReadDests = Callable[[list[Dest]], None]


def execute(
    reqs: list[Request],
    read: ReadDests,
    *,
    memory_budget: int | None,
    stats: ReadStats,
    expand: Expand | None = None,
) -> list[Any]:
    """Read and build every request, in batches that fit the memory budget (jax.Arrays only).

    Returns the built values in the order of `reqs`.
    """
    budget = None if all(r.kind in ("numpy", "scalar") for r in reqs) else memory_budget
    if any(len(d.devices) > 1 and d.devices[0].platform == "cpu" for r in reqs for d in r.dests):
        from .adapters.jax_arrays import start_cpu_donation_check

        start_cpu_donation_check()  # overlaps the reads (see array_from_host_boxes)
    results: dict[int, Any] = {}
    for batch in batches(reqs, lambda r: r.nbytes, budget):
        t0 = time.perf_counter()
        dests = [d for r in batch for d in r.dests]
        steps: list[Callable[[], None]] = []
        if expand is not None:
            dests, steps = expand(dests)
        read(dests)
        for step in steps:
            step()
        t1 = time.perf_counter()
        for r in batch:
            results[id(r)] = build(r)
            r.dests.clear()
        stats.read_s += t1 - t0
        stats.assemble_s += time.perf_counter() - t1
    return [results[id(r)] for r in reqs]


def reader_of(
    storage: Storage, manifest: Manifest, options: ReadOptions, stats: ReadStats
) -> ReadDests:
    """The restore's reads of a snapshard checkpoint as a ReadDests (`options`: verify,
    threads, max_gap); v2 chunk records are fetched as the dests need them."""
    finder = manifest.finder if manifest.version >= 2 else None
    if manifest.version >= 2 and finder is None:
        finder = manifest.finder = ChunkFinder(storage, manifest)
    return lambda dests: _read_dests(
        storage, manifest.files, finder, dests, options.verify, options.threads, options.max_gap, stats
    )


def table_reader(
    storage: Storage, files: Sequence[FileEntry], options: ReadOptions, stats: ReadStats
) -> ReadDests:
    """The reads of arrays whose chunk tables are in memory (`leaf.chunks`, numbering
    `files`): sources of other formats (safetensors files)."""
    return lambda dests: _read_dests(
        storage, files, None, dests, options.verify, options.threads, options.max_gap, stats
    )
