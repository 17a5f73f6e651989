"""Format v2: reading the record files of a checkpoint.

The directory entries and record segments of the leaves a reader needs are fetched with
ranged reads, coalesced per record file (`span_heads`), and checked against their checksums
before they are decoded; many record files are read at once (`each_file`).
`snapshard verify` reads every record file whole instead (`check_record_files`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..checksum import crc32c
from ..errors import CorruptCheckpointError
from . import records as rec
from .binding import name_key
from .leaves import ArrayLeaf
from .manifest import Manifest

if TYPE_CHECKING:
    from ..storage import Storage

T = TypeVar("T")

# Reads of one record file closer than this are merged into one (`RecordReader._read`).
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
class RecordReader:
    """The records of a checkpoint's leaves, per process: read, checked and decoded, and the
    record bytes read so far counted (reads run in many threads at once)."""

    storage: Storage
    manifest: Manifest
    metadata_bytes: int = 0  # record bytes read so far
    _lock: threading.Lock = field(default_factory=threading.Lock)

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
        """Byte ranges [lo, hi) of one committed file, read in spans (`span_heads`): the
        bytes of every range back to back in file order, and where each starts in them
        (in the order of `lo`: a process's own leaves of a 2.2 manifest need not follow the
        manifest's order)."""
        if not len(lo):
            return b"", np.zeros(0, np.int64)
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
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
        out = np.empty_like(pos)
        out[order] = pos
        return b"".join(parts), out

    def fetch(self, q: int, leaves: list[int]) -> dict[int, ProcessRecords]:
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
        ndim = self.ndims[a]
        offset, length = rec.check_entries(entries, ndim, size, where)
        has = np.flatnonzero(length > 0)
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
        return {nd: ProcessRecords.decode(q, group, nd) for nd, group in by_ndim.items()}

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

    def fetch_hashed(
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
        found = rec.decode_entries(b"".join(entries))
        ndims = self.ndims[np.asarray(leaves, np.int64)]
        offsets, lengths = rec.check_entries(found, ndims, size, where)
        for a, e, ndim, off, length in zip(
            leaves, found, ndims.tolist(), offsets.tolist(), lengths.tolist(), strict=True
        ):
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

    @cached_property
    def ndims(self) -> np.ndarray:
        """Each leaf's number of axes (0 for leaves without chunks), computed once."""
        leaves = self.manifest.leaves
        return np.asarray(
            [len(x.shape) if isinstance(x, ArrayLeaf) else 0 for x in leaves], np.int64
        )


def each_file(fn: Callable[[int, list[int]], T], items: list[tuple[int, list[int]]]) -> list[T]:
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
class ProcessRecords:
    """One process's records of several leaves with the same number of axes, decoded in
    one pass: the records of leaf `leaves[i]` are rows bounds[i]:bounds[i + 1] of `recs`.
    A restore of many small arrays would otherwise pay NumPy's cost per call per leaf."""

    process: int
    ndim: int
    leaves: list[int]
    bounds: np.ndarray
    recs: np.ndarray  # record_dtype(ndim) rows

    @staticmethod
    def decode(process: int, group: list[tuple[int, memoryview]], ndim: int) -> ProcessRecords:
        dt = rec.record_dtype(ndim)
        recs = np.frombuffer(b"".join(d for _, d in group), dt)
        counts = np.asarray([len(d) // dt.itemsize for _, d in group], np.int64)
        bounds = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
        return ProcessRecords(process, ndim, [a for a, _ in group], bounds, recs)

    def leaf_at(self, row: int) -> int:
        """The manifest index of the leaf row `row` is a record of."""
        return self.leaves[int(np.searchsorted(self.bounds, row, side="right")) - 1]

    def leaf_of_rows(self) -> np.ndarray:
        """The manifest index of the leaf each row is a record of."""
        return np.repeat(np.asarray(self.leaves, np.int64), np.diff(self.bounds))


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
        if crc32c(bytes(buf)) != table.record_crcs[q]:
            raise CorruptCheckpointError(f"{where}: record file fails its checksum")
