"""Format v2: find the chunks that boxes of saved arrays overlap, reading only their records.

For each array, the layout description says which processes held each saved box, hence
which processes may have written chunks a box overlaps (narrowed by the leaf's `writers`
where listed). Their directory entries and record segments are fetched with ranged reads,
coalesced per record file, and checked against their checksums and the manifest's bounds
before a single data byte is read. The planner's tiling guarantees the chunks found cover
every box; the restore checks that too (see reading.plan_reads).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..dtypes import NAME_TO_DTYPE
from ..errors import CorruptCheckpointError
from ..planning.layout import ArrayLayout, ShardGroups
from ..planning.overlaps import ChunkIndex
from . import records as rec
from .binding import name_key
from .chunks import ChunkTable, LazyChunkTable, shared_boxes
from .layouts import Mesh, host_holders, mesh_layout, rows_layout
from .leaves import ArrayLeaf
from .manifest import Manifest
from .validate import check_array_rows

if TYPE_CHECKING:
    from ..storage import Storage

T = TypeVar("T")
BoundsArrays = tuple[np.ndarray, np.ndarray]  # a box as (start, stop) arrays
# Reads of one record file closer than this are merged into one (`ChunkFinder._read`).
_MERGE_GAP = 64 << 10
# Record reads of a restore (`span_heads`): ranges this close always share a request; a
# span of ranges is read whole while it is at most this many times the bytes they need.
# (A process restoring the replicated arrays another wrote needs every P-th segment of
# its record file, some hundreds of bytes apart: one request for all, not one each.)
_TOUCH_GAP = 4096
_SPAN_SLACK = 1.25
# Record reads are small and bound by the store's latency (two requests in a row per record
# file: directory entries, then segments), and a restore touches hundreds of record files
# (the writers of replicated arrays are spread over the job): many run at once.
RECORD_READ_THREADS = 64


@dataclass
class _Holders:
    groups: ShardGroups
    index: ChunkIndex


@dataclass
class ChunkFinder:
    """Chunk tables of v2 arrays, restricted to the boxes asked for."""

    storage: Storage
    manifest: Manifest
    metadata_bytes: int = 0  # record bytes read so far
    _holders: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    _meshes: dict[int, Mesh] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # Tables with equal boxes share their box columns, hence one index in the restore.
    _boxes: dict[bytes, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {id(leaf): i for i, leaf in enumerate(self.manifest.leaves)}

    # ---- who held what -----------------------------------------------------------------
    def _layout(self, leaf: ArrayLeaf) -> ArrayLayout:
        m = self.manifest
        where = f"{self.storage.url}, leaf {leaf.name!r}"
        if leaf.layout is None or not 0 <= leaf.layout < len(m.layouts):
            raise CorruptCheckpointError(f"{where}: layout {leaf.layout} is not in the manifest")
        d = m.layouts[leaf.layout]
        kind = d.get("kind")
        if kind == "host":
            return host_holders(leaf.shape, 1, m.process_count)
        if kind == "rows":
            lay = rows_layout(d.get("rows"), leaf.shape, 1, d.get("devices"), where)
        elif kind == "mesh":
            mid = d.get("mesh")
            if not isinstance(mid, int) or not 0 <= mid < len(m.meshes):
                raise CorruptCheckpointError(
                    f"{where}: layout names mesh {mid!r}, not in the manifest"
                )
            if mid not in self._meshes:
                self._meshes[mid] = Mesh.from_json(m.meshes[mid], where)
            spec = d.get("spec")
            if not isinstance(spec, list) or not all(
                isinstance(s, list) and all(isinstance(a, str) for a in s) for s in spec
            ):
                raise CorruptCheckpointError(f"{where}: malformed layout spec")
            lay = mesh_layout(self._meshes[mid], spec, leaf.shape, 1, where)
        else:
            raise CorruptCheckpointError(f"{where}: unknown layout kind {str(kind)[:50]!r}")
        if int(lay.process_ids.max()) >= m.process_count:
            raise CorruptCheckpointError(
                f"{where}: layout names a process beyond {m.process_count}"
            )
        return lay

    def holders(self, leaf: ArrayLeaf) -> _Holders:
        key = (leaf.layout, leaf.shape)
        h = self._holders.get(key)
        if h is None:
            groups = self._layout(leaf).shards
            h = self._holders[key] = _Holders(groups, ChunkIndex(groups.starts, groups.stops))
        return h

    def _mesh_grid(self, leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
        """For a mesh layout: the process of every mesh position arranged as (pieces of array
        axis 0, pieces of axis 1, …, the other mesh axes), and each axis's piece length;
        None for other layouts. Holders of a box are then one block of it, with no per-device
        rows built."""
        key = ("grid", leaf.layout, leaf.shape)
        if key in self._holders:
            return self._holders[key]
        d = self.manifest.layouts[leaf.layout] if leaf.layout is not None else {}
        grid = None
        if d.get("kind") == "mesh":
            self._layout(leaf)  # validates the description (and is cheap to build)
            mesh = self._meshes[d["mesh"]]
            spec: list[list[str]] = d["spec"]
            used = [mesh.axes.index(a) for axes in spec for a in axes]
            rest = [i for i in range(len(mesh.shape)) if i not in used]
            pieces = [math.prod(mesh.shape[mesh.axes.index(a)] for a in axes) for axes in spec]
            t = mesh.processes.reshape(mesh.shape).transpose(used + rest)
            t = t.reshape([*pieces, -1])
            steps = np.asarray([n // k for n, k in zip(leaf.shape, pieces, strict=True)], np.int64)
            grid = (t, np.maximum(steps, 1))
        self._holders[key] = grid
        return grid

    def candidates(self, leaf: ArrayLeaf, boxes: Sequence[BoundsArrays]) -> np.ndarray:
        """The processes that may have written chunks overlapping `boxes`."""
        if leaf.writers is not None and len(leaf.writers) <= 64:
            return np.asarray(leaf.writers, np.int64)
        grid = self._mesh_grid(leaf)
        if grid is not None:
            t, steps = grid
            blocks = [
                t[tuple(slice(a, b) for a, b in zip((s // steps).tolist(), (-(-e // steps)).tolist(), strict=True))]
                for s, e in boxes
            ]  # fmt: skip
            procs = np.unique(np.concatenate([b.reshape(-1) for b in blocks]))
            if leaf.writers is not None:
                procs = np.intersect1d(procs, np.asarray(leaf.writers, np.int64))
            return procs
        h = self.holders(leaf)
        g = h.groups
        parts = []
        for start, stop in boxes:
            u = h.index.overlapping(start, stop)
            if len(u) == g.count:
                parts = [g.cand_process]
                break
            lo, hi = g.cand_ptr[u], g.cand_ptr[u + 1]
            parts.extend(g.cand_process[a:b] for a, b in zip(lo.tolist(), hi.tolist(), strict=True))
        procs = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        if leaf.writers is not None:
            procs = np.intersect1d(procs, np.asarray(leaf.writers, np.int64))
        return procs

    # ---- fetching records ----------------------------------------------------------------
    def _read(self, name: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Byte ranges of one committed file, merging ranges that (nearly) touch."""
        out: dict[tuple[int, int], bytes] = {}
        merged: list[list[Any]] = []
        for a, b in sorted(set(ranges)):
            if merged and a <= merged[-1][1] + _MERGE_GAP:
                merged[-1][1] = max(merged[-1][1], b)
                merged[-1][2].append((a, b))
            else:
                merged.append([a, b, [(a, b)]])
        for a, b, members in merged:
            buf = bytearray(b - a)
            if b > a:
                self.storage.read_into(name, a, [memoryview(buf)])
            with self._lock:
                self.metadata_bytes += b - a
            for x, y in members:
                out[(x, y)] = bytes(buf[x - a : y - a])
        return [out[r] for r in ranges]

    def _read_spans(self, name: str, lo: np.ndarray, hi: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Byte ranges [lo, hi) of one committed file (sorted by lo), read in spans
        (`span_heads`): the bytes of every range back to back, and where each starts in
        them."""
        if not len(lo):
            return b"", np.zeros(0, np.int64)
        first = span_heads(lo, hi)
        last = np.append(first[1:], len(lo)) - 1
        parts, pos, at = [], np.empty(len(lo), np.int64), 0
        for i, j in zip(first.tolist(), last.tolist(), strict=True):
            a, b = int(lo[i]), int(hi[i : j + 1].max())
            buf = bytearray(b - a)
            if b > a:
                self.storage.read_into(name, a, [memoryview(buf)])
            with self._lock:
                self.metadata_bytes += b - a
            pos[i : j + 1] = at + lo[i : j + 1] - a
            parts.append(buf)
            at += b - a
        return b"".join(parts), pos

    def _fetch_process(self, q: int, leaves: list[int]) -> dict[int, _Fetched]:
        """Process q's records of `leaves` (manifest leaf indices, ascending), read and
        checked together: per number of axes, the records of every such leaf back to back."""
        m = self.manifest
        assert m.processes is not None
        name = m.processes.record_name(q)
        size = m.processes.record_sizes[q]
        where = f"{self.storage.url}/{name}"
        n = m.processes.leaf_count(q, len(m.leaves))
        if rec.directory_offset(n) > size:
            raise CorruptCheckpointError(f"{where}: record file is smaller than its directory")
        a = np.asarray(leaves, np.int64)
        local = self._local(q, a, where)
        at = rec.HEADER_SIZE + local * rec.DIR_ENTRY_SIZE
        raw, pos = self._read_spans(name, at, at + rec.DIR_ENTRY_SIZE)
        whole = np.frombuffer(raw, rec.DIR_ENTRY)
        entries = whole[pos // rec.DIR_ENTRY_SIZE]
        ndim = self._ndims[a]
        count = entries["count"].astype(np.int64)
        offset = entries["offset"].astype(np.int64)
        length = count * (rec.RECORD_FIXED.itemsize + 16 * ndim)
        bad = (count > 0) & ((offset < rec.HEADER_SIZE) | (offset + length > size))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise CorruptCheckpointError(
                f"{where}: directory entry points outside the record file "
                f"({int(count[i])} records at {int(offset[i])})"
            )
        has = np.flatnonzero(count > 0)
        order = has[np.argsort(offset[has], kind="stable")]
        raw, pos = self._read_spans(name, offset[order], offset[order] + length[order])
        salt = name_key(name) if m.bound else 0
        view = memoryview(raw)
        got = [
            (int(a[i]), view[p : p + int(length[i])])
            for i, p in zip(order.tolist(), pos.tolist(), strict=True)
        ]
        crcs = entries["crc"][order].tolist()
        for (leaf, data), crc, own in zip(got, crcs, local[order].tolist(), strict=True):
            if rec.segment_crc(data, q, own, salt) != crc:
                raise CorruptCheckpointError(
                    f"{where}, leaf {m.leaves[leaf].name!r}: chunk records fail their checksum"
                )
        by_ndim: dict[int, list[tuple[int, memoryview]]] = {}
        for (leaf, data), nd in zip(got, ndim[order].tolist(), strict=True):
            by_ndim.setdefault(nd, []).append((leaf, data))
        return {nd: _Fetched.decode(q, group, nd) for nd, group in by_ndim.items()}

    def _local(self, q: int, leaves: np.ndarray, where: str) -> np.ndarray:
        """The numbers of manifest leaves `leaves` in process q's record file; each must be
        one q saved (the layouts name q as a holder of them)."""
        local = self.manifest.local_leaves(q, leaves)
        if len(local) and int(local.min()) < 0:
            leaf = self.manifest.leaves[int(leaves[int(np.argmin(local))])]
            raise CorruptCheckpointError(
                f"{where}: leaf {leaf.name!r} names process {q} as a holder, which did not save it"
            )
        return local

    def hashed_records(
        self, wants: Sequence[tuple[ArrayLeaf, Sequence[BoundsArrays]]], hash_fn: int
    ) -> dict[int, list[tuple[int, rec.Records, np.ndarray | None]]]:
        """For each leaf (keyed by id), per process that may hold chunks of its boxes: that
        process's records of it, with their content hashes where its record file stores
        hashes made by function `hash_fn` (None otherwise). What an incremental save
        compares its chunks with; each record file is read once, its ranges merged."""
        by_process: dict[int, list[int]] = {}
        for leaf, boxes in wants:
            for q in self.candidates(leaf, boxes).tolist():
                by_process.setdefault(q, []).append(self.index[id(leaf)])
        items = sorted(by_process.items())
        results = _each(partial(self._fetch_hashed, hash_fn=hash_fn), items)
        out: dict[int, list[tuple[int, rec.Records, np.ndarray | None]]] = {
            id(leaf): [] for leaf, _ in wants
        }
        for (q, _), got in zip(items, results, strict=True):
            for a, (records, hashes) in got.items():
                out[id(self.manifest.leaves[a])].append((q, records, hashes))
        return out

    def _fetch_hashed(
        self, q: int, leaves: list[int], hash_fn: int
    ) -> dict[int, tuple[rec.Records, np.ndarray | None]]:
        """Process q's records of `leaves` with their hashes (leaves it wrote none of left out)."""
        m = self.manifest
        assert m.processes is not None
        name = m.processes.record_name(q)
        size = m.processes.record_sizes[q]
        where = f"{self.storage.url}/{name}"
        local = self._local(q, np.asarray(leaves, np.int64), where).tolist()
        header, *entries = self._read(
            name,
            [(0, rec.HEADER_SIZE)]
            + [(rec.directory_offset(a), rec.directory_offset(a + 1)) for a in local],
        )
        rec.decode_header(header, where, q, m.processes.leaf_count(q, len(m.leaves)))
        flags = rec.header_flags(header)
        hashed = bool(flags & rec.FILE_HASHES) and (flags >> rec.HASH_SHIFT) & 0xFF == hash_fn
        wanted: list[tuple[int, np.void, int, int, tuple[int, int]]] = []
        own = dict(zip(leaves, local, strict=True))
        for a, raw in zip(leaves, entries, strict=True):
            e = rec.decode_entries(raw)[0]
            ndim = len(m.leaves[a].shape)  # type: ignore[union-attr]
            off, length = rec.check_entry(e, ndim, size, where)
            if length:
                extra = rec.HASH_SIZE * int(e["count"]) + 4 if hashed else 0
                wanted.append((a, e, ndim, length, (off, min(off + length + extra, size))))
        segments = self._read(name, [r for *_, r in wanted])
        salt = name_key(name) if m.bound else 0
        out = {}
        for (a, e, ndim, length, _), raw in zip(wanted, segments, strict=True):
            at = f"{where}, leaf {m.leaves[a].name!r}"
            records = rec.decode_segment(raw[:length], e, ndim, q, own[a], at, salt)
            out[a] = (records, rec.decode_hashes(raw[length:], e, ndim, at) if hashed else None)
        return out

    def tables(
        self, wants: Sequence[tuple[ArrayLeaf, Sequence[BoundsArrays]]]
    ) -> dict[int, ChunkTable]:
        """For each leaf (keyed by id), the chunks written by every process that may hold
        chunks overlapping its boxes."""
        leaves: dict[int, ArrayLeaf] = {}
        memo: dict[tuple[Any, ...], tuple[int, ...]] = {}
        # (the same by the ids of the box arrays: the dests of arrays alike share them, and
        # `wants` keeps them alive through the call)
        by_ids: dict[tuple[Any, ...], tuple[int, ...]] = {}
        of_procs: dict[tuple[int, ...], list[int]] = {}  # the leaves of each set of processes
        empty: dict[int, ChunkTable] = {}
        for leaf, boxes in wants:
            if 0 in leaf.shape:
                empty[id(leaf)] = ChunkTable.empty(len(leaf.shape))
                continue
            a = self.index[id(leaf)]
            leaves[a] = leaf
            kind = (leaf.layout, leaf.shape, leaf.writers)
            ids = (*kind, *(id(x) for box in boxes for x in box))
            procs = by_ids.get(ids)
            if procs is None:
                key = (*kind, b"".join(s.tobytes() + e.tobytes() for s, e in boxes))
                procs = memo.get(key)
                if procs is None:
                    procs = memo[key] = tuple(self.candidates(leaf, boxes).tolist())
                by_ids[ids] = procs
            of_procs.setdefault(procs, []).append(a)
        by_process: dict[int, list[int]] = {}
        for procs, some in of_procs.items():
            for q in procs:
                by_process.setdefault(q, []).extend(some)
        items = sorted((q, sorted(a)) for q, a in by_process.items())
        results = _each(self._fetch_process, items)
        out = self._assemble(leaves, [f for got in results for f in got.values()])
        out.update(empty)
        return out

    def _assemble(
        self, leaves: dict[int, ArrayLeaf], found: list[_Fetched]
    ) -> dict[int, ChunkTable]:
        """Each leaf's chunk table (keyed by id) from the records `found` in the record files
        of the processes that hold them: per number of axes, the records of every leaf and
        process in one table, sorted by leaf and box, checked at once (check_array_rows),
        then cut into the leaves' own tables (views), leaves with equal boxes sharing their
        box columns (one index serves them in the restore)."""
        ndims = self._ndims
        by_ndim: dict[int, list[int]] = {}
        for a in sorted(leaves):  # (ascending: searched below)
            by_ndim.setdefault(int(ndims[a]), []).append(a)
        fetched: dict[int, list[_Fetched]] = {}
        for f in found:
            fetched.setdefault(f.ndim, []).append(f)
        sizes = self._per_process[2]
        out: dict[int, ChunkTable] = {}
        for nd, ids in by_ndim.items():
            group = [leaves[a] for a in ids]
            for leaf in group:
                if leaf.dtype not in NAME_TO_DTYPE:
                    raise CorruptCheckpointError(
                        f"{self._where(leaf)}: unknown dtype {leaf.dtype!r}"
                    )
            parts = fetched.get(nd, [])
            t = ChunkTable.concat([f.table(self) for f in parts], nd)
            leaf_of = np.concatenate([np.zeros(0, np.int64), *(f.leaf_of_rows() for f in parts)])
            order = np.lexsort((*t.starts.T[::-1], leaf_of))  # by leaf, then box
            t = t.take(order) if len(t) > 1 else t
            at = np.searchsorted(np.asarray(ids, np.int64), leaf_of[order])
            counts = np.bincount(at, minlength=len(ids))
            bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            _check_found(group, counts, self._where)
            check_array_rows(
                group, t, bounds, self._where,
                [NAME_TO_DTYPE[leaf.dtype].itemsize for leaf in group], sizes,
            )  # fmt: skip
            boxes = self._shared_boxes(t, bounds)
            rows = zip(bounds[:-1].tolist(), bounds[1:].tolist(), boxes, strict=True)
            for leaf, (lo, hi, own) in zip(group, rows, strict=True):
                out[id(leaf)] = t.between(lo, hi, own)
        return out

    def _shared_boxes(self, t: ChunkTable, bounds: np.ndarray) -> list[BoundsArrays]:
        """The box columns of each leaf's rows bounds[i]:bounds[i + 1] of `t` (at least one
        each), equal ones as one pair of arrays, shared with the tables of earlier calls
        (`_boxes`): one index then serves arrays alike in the restore. Leaves with as many
        rows are grouped by their boxes with one sort of integer columns, not one by one."""
        counts = np.diff(bounds)
        nd = t.starts.shape[1]
        out: list[BoundsArrays] = [None] * len(counts)  # type: ignore[list-item]
        for k in np.unique(counts).tolist():
            which = np.flatnonzero(counts == k)
            rows = bounds[which][:, None] + np.arange(k)
            both = np.concatenate(
                [t.starts[rows].reshape(len(which), -1), t.stops[rows].reshape(len(which), -1)],
                axis=1,
            )
            order = np.lexsort(both.T[::-1]) if both.shape[1] else np.arange(len(which))
            both = both[order]
            new = np.ones(len(which), bool)  # where a run of equal boxes starts
            new[1:] = np.any(both[1:] != both[:-1], axis=1)
            heads = np.flatnonzero(new)
            pairs = []
            for u in both[heads]:
                s, e = u[: k * nd].reshape(k, nd).copy(), u[k * nd :].reshape(k, nd).copy()
                pairs.append(shared_boxes(self._boxes, s, e))
            kind = np.cumsum(new) - 1
            for i, j in zip(which[order].tolist(), kind.tolist(), strict=True):
                out[i] = pairs[j]
        return out

    def _where(self, leaf: ArrayLeaf) -> str:
        """The leaf, named in errors (made only for one)."""
        return f"{self.storage.url}, leaf {leaf.name!r}"

    @cached_property
    def _ndims(self) -> np.ndarray:
        """Each leaf's number of axes (0 for leaves without chunks), computed once."""
        leaves = self.manifest.leaves
        return np.asarray(
            [len(x.shape) if isinstance(x, ArrayLeaf) else 0 for x in leaves], np.int64
        )

    @cached_property
    def _per_process(self) -> tuple[np.ndarray, list[int], np.ndarray, np.ndarray | None]:
        """Each process's first global file number, its data file count, every data file's
        size and (2.1) name key, computed once: per leaf they would cost O(processes) each."""
        m, table = self.manifest, self.manifest.processes
        assert table is not None
        sizes = np.asarray([f.size for f in m.files], dtype=np.int64)
        keys = np.asarray([f.key or 0 for f in m.files], np.int64) if m.bound else None
        return table.base, [len(s) for s in table.data_sizes], sizes, keys

    def full_table(self, leaf: ArrayLeaf) -> ChunkTable:
        """Every chunk of an array (for tools that walk them all)."""
        whole = (np.zeros(len(leaf.shape), np.int64), np.asarray(leaf.shape, np.int64))
        t = self.tables([(leaf, [whole])])[id(leaf)]
        if leaf.chunk_count is not None and len(t) != leaf.chunk_count:
            raise CorruptCheckpointError(
                f"{self.storage.url}, leaf {leaf.name!r}: {len(t)} chunk records found, "
                f"the manifest says {leaf.chunk_count}"
            )
        return t


def _each(fn: Callable[[int, list[int]], T], items: list[tuple[int, list[int]]]) -> list[T]:
    """fn(q, leaves) of every record file, many at once (reads bound by the store's latency)."""
    if len(items) < 2:
        return [fn(q, a) for q, a in items]
    with ThreadPoolExecutor(min(RECORD_READ_THREADS, len(items)), "snapshard-records") as pool:
        return list(pool.map(lambda qa: fn(*qa), items))


def span_heads(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Where the spans that read byte ranges [lo, hi) (sorted by lo) start: a range joins
    the span before it where the bytes between cost less than a request, i.e. where they
    are few (_TOUCH_GAP) or the span would still be at most _SPAN_SLACK times the bytes its
    ranges need. A reader of a few leaves of each of many record files then reads about
    what it needs, and a reader of most of a file reads it with few requests."""
    heads = [0]
    start, end, need = int(lo[0]), int(hi[0]), int(hi[0] - lo[0])
    for i, (a, b) in enumerate(zip(lo[1:].tolist(), hi[1:].tolist(), strict=True), 1):
        span = max(end, b) - start
        if a - end <= _TOUCH_GAP or span <= _SPAN_SLACK * (need + b - a):
            end, need = max(end, b), need + b - a
        else:
            heads.append(i)
            start, end, need = a, b, b - a
    return np.asarray(heads, np.int64)


@dataclass
class _Fetched:
    """One process's records of several leaves with the same number of axes, decoded in
    one pass: the records of leaf `leaves[i]` are rows bounds[i]:bounds[i + 1] of `recs`.
    A restore of many small arrays would otherwise pay NumPy's cost per call per leaf."""

    process: int
    ndim: int
    leaves: list[int]
    bounds: np.ndarray
    recs: np.ndarray  # record_dtype(ndim) rows

    @staticmethod
    def decode(process: int, group: list[tuple[int, memoryview]], ndim: int) -> _Fetched:
        dt = rec.record_dtype(ndim)
        recs = np.frombuffer(b"".join(d for _, d in group), dt)
        counts = np.asarray([len(d) // dt.itemsize for _, d in group], np.int64)
        bounds = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
        return _Fetched(process, ndim, [a for a, _ in group], bounds, recs)

    def _where(self, finder: ChunkFinder, row: int) -> str:
        a = self.leaves[int(np.searchsorted(self.bounds, row, side="right")) - 1]
        return f"{finder.storage.url}, leaf {finder.manifest.leaves[a].name!r}"

    def leaf_of_rows(self) -> np.ndarray:
        """The manifest index of the leaf each row is a record of."""
        return np.repeat(np.asarray(self.leaves, np.int64), np.diff(self.bounds))

    def table(self, finder: ChunkFinder) -> ChunkTable:
        """Every row as a chunk of one table: global file numbers, flags checked (the rows
        of many leaves: `ChunkFinder._assemble` cuts it up)."""
        m, q, r = finder.manifest, self.process, self.recs
        assert m.processes is not None
        base, nfiles_of, _, file_keys = finder._per_process
        n, nd = len(r), r["start"].shape[1] if r["start"].ndim > 1 else 0
        starts = r["start"].astype(np.int64).reshape(n, nd)
        stops = r["stop"].astype(np.int64).reshape(n, nd)
        file, flags = r["file"].astype(np.int64), r["flags"].astype(np.int64)
        codec = None
        if flags.any():  # references or codecs (most records have no flags at all)
            ref = (flags & rec.FLAG_REFERENCE) != 0
            codec = rec.codecs_of(flags)
            bits = flags & ~(rec.FLAG_REFERENCE | rec.CODEC_MASK)
            unknown = np.flatnonzero((bits != 0) | (codec > max(rec.CODECS)))
            if len(unknown):  # the first such record, its flag bits named first
                i = int(unknown[0])
                at = f"{self._where(finder, i)}: a record of {m.processes.record_name(q)}"
                raise CorruptCheckpointError(
                    f"{at} has unknown flag bits {int(bits[i]):#x}, which this version does not read"
                    if bits[i]
                    else f"{at} uses codec {int(codec[i])}, which this version does not read"
                )
            bad = np.where(ref, file >= len(m.refs), file >= nfiles_of[q])
            file = np.where(ref, int(base[-1]) + file, base[q] + file)
        else:
            bad = file >= nfiles_of[q]
            file = base[q] + file
        if bad.any():
            raise CorruptCheckpointError(
                f"{self._where(finder, int(np.flatnonzero(bad)[0]))}: a record of process {q} "
                "names a file it did not write"
            )
        offset, nbytes, block, crc_offset, nblocks = (
            r[k].astype(np.int64) for k in ("offset", "nbytes", "block", "crc_offset", "nblocks")
        )
        codecs = None if codec is None else flags & rec.CODEC_MASK
        return ChunkTable(starts, stops, file, offset, nbytes, block, [], crc_offset, codecs,
                          file_keys, nblocks)  # fmt: skip


def _check_found(
    leaves: list[ArrayLeaf], counts: np.ndarray, where: Callable[[ArrayLeaf], str]
) -> None:
    """Records were found for every array (of elements), and no more than the manifest
    counts (`counts`: the records found of each of `leaves`)."""
    stated = np.asarray([-1 if x.chunk_count is None else x.chunk_count for x in leaves], np.int64)
    bad = (counts == 0) | ((stated >= 0) & (counts > stated))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CorruptCheckpointError(
            f"{where(leaves[i])}: {int(counts[i])} chunk records found, the manifest says "
            f"{leaves[i].chunk_count}"
        )


def attach_lazy_tables(storage: Storage, manifest: Manifest) -> ChunkFinder:
    """Give every array of a v2 manifest a chunk table fetched on first use."""
    finder = ChunkFinder(storage, manifest)
    for leaf in manifest.arrays:  # (a partial: a third of a closure's memory per leaf)
        leaf.chunks = LazyChunkTable(partial(finder.full_table, leaf))
    return finder


def loaded_table(leaf: ArrayLeaf) -> ChunkTable | None:
    """The leaf's table if it is in memory (v1, or a v2 table already fetched)."""
    t = leaf.chunks
    return None if isinstance(t, LazyChunkTable) and "_load" in t.__dict__ else t


def check_record_files(storage: Storage, manifest: Manifest) -> None:
    """Read every record file whole and check it against the manifest's size and crc32c
    (what `snapshard verify` adds to the checks a restore makes)."""
    table = manifest.processes
    assert table is not None
    for q in range(len(table)):
        name = table.record_name(q)
        where = f"{storage.url}/{name}"
        size = table.record_sizes[q]
        buf = bytearray(size)
        storage.read_into(name, 0, [memoryview(buf)])
        leaves = table.leaf_count(q, len(manifest.leaves))
        stated = rec.decode_header(bytes(buf[: rec.HEADER_SIZE]), where, q, leaves)
        if stated != size:
            raise CorruptCheckpointError(
                f"{where}: record file says {stated} bytes, the manifest {size}"
            )
        from ..checksum import crc32c

        if crc32c(bytes(buf)) != table.record_crcs[q]:
            raise CorruptCheckpointError(f"{where}: record file fails its checksum")
