"""Format v2: find the chunks that boxes of saved arrays overlap, reading only their records.

The records of each box come from the processes that may have written chunks it overlaps
(layouts.Holders), fetched from their record files (record_reads.py), and are checked against
the manifest's bounds before a single data byte is read. The planner's tiling guarantees the
chunks found cover every box; the restore checks that too (see reading.plan_reads).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import NAME_TO_DTYPE
from ..errors import CorruptCheckpointError
from . import records as rec
from .chunk_checks import check_array_rows
from .chunks import ChunkTable, LazyChunkTable, shared_boxes
from .layouts import BoundsArrays, Holders
from .leaves import ArrayLeaf, Leaf
from .manifest import Manifest
from .record_reads import ProcessRecords, RecordReader, each_file

if TYPE_CHECKING:
    from ..storage import Storage


@dataclass
class ChunkFinder:
    """Chunk tables of v2 arrays, restricted to the boxes asked for."""

    storage: Storage
    manifest: Manifest
    # Tables with equal boxes share their box columns, hence one index in the restore.
    _boxes: dict[bytes, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {id(leaf): i for i, leaf in enumerate(self.manifest.leaves)}
        self.holders = Holders(self.manifest, self.storage.url)
        self.records = RecordReader(self.storage, self.manifest)

    def hashed_records(
        self, wants: Sequence[tuple[ArrayLeaf, Sequence[BoundsArrays]]], hash_fn: int
    ) -> dict[int, list[tuple[int, rec.Records, np.ndarray | None]]]:
        """For each leaf (keyed by id), per process that may hold chunks of its boxes: that
        process's records of it, with their content hashes where its record file stores
        hashes made by function `hash_fn` (None otherwise). What an incremental save
        compares its chunks with; each record file is read once, its ranges merged."""
        by_process: dict[int, list[int]] = {}
        for leaf, boxes in wants:
            for q in self.holders.candidates(leaf, boxes).tolist():
                by_process.setdefault(q, []).append(self.index[id(leaf)])
        items = sorted(by_process.items())
        results = each_file(partial(self.records.fetch_hashed, hash_fn=hash_fn), items)
        out: dict[int, list[tuple[int, rec.Records, np.ndarray | None]]] = {
            id(leaf): [] for leaf, _ in wants
        }
        for (q, _), got in zip(items, results, strict=True):
            for a, (records, hashes) in got.items():
                out[id(self.manifest.leaves[a])].append((q, records, hashes))
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
                    procs = memo[key] = tuple(self.holders.candidates(leaf, boxes).tolist())
                by_ids[ids] = procs
            of_procs.setdefault(procs, []).append(a)
        by_process: dict[int, list[int]] = {}
        for procs, some in of_procs.items():
            for q in procs:
                by_process.setdefault(q, []).extend(some)
        items = sorted((q, sorted(a)) for q, a in by_process.items())
        results = each_file(self.records.fetch, items)
        out = self._assemble(leaves, [f for got in results for f in got.values()])
        out.update(empty)
        return out

    def _assemble(
        self, leaves: dict[int, ArrayLeaf], found: list[ProcessRecords]
    ) -> dict[int, ChunkTable]:
        """Each leaf's chunk table (keyed by id) from the records `found` in the record files
        of the processes that hold them: per number of axes, the records of every leaf and
        process in one table, sorted by leaf and box, checked at once (check_array_rows),
        then cut into the leaves' own tables (views), leaves with equal boxes sharing their
        box columns (one index serves them in the restore)."""
        ndims = self.records.ndims
        by_ndim: dict[int, list[int]] = {}
        for a in sorted(leaves):  # (ascending: searched below)
            by_ndim.setdefault(int(ndims[a]), []).append(a)
        fetched: dict[int, list[ProcessRecords]] = {}
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
            t = ChunkTable.concat([self._table(f) for f in parts], nd)
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

    def _table(self, f: ProcessRecords) -> ChunkTable:
        """Every row of `f` as a chunk of one table: global file numbers, flags checked (the
        rows of many leaves: `_assemble` cuts it up)."""
        m, q, r = self.manifest, f.process, f.recs
        assert m.processes is not None
        base, nfiles_of, _, file_keys = self._per_process
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
                leaf = m.leaves[f.leaf_at(i)]
                at = f"{self._where(leaf)}: a record of {m.processes.record_name(q)}"
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
            leaf = m.leaves[f.leaf_at(int(np.flatnonzero(bad)[0]))]
            raise CorruptCheckpointError(
                f"{self._where(leaf)}: a record of process {q} names a file it did not write"
            )
        offset, nbytes, block, crc_offset, nblocks = (
            r[k].astype(np.int64) for k in ("offset", "nbytes", "block", "crc_offset", "nblocks")
        )
        codecs = None if codec is None else flags & rec.CODEC_MASK
        return ChunkTable(starts, stops, file, offset, nbytes, block, [], crc_offset, codecs,
                          file_keys, nblocks)  # fmt: skip

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

    def _where(self, leaf: Leaf) -> str:
        """The leaf, named in errors (made only for one)."""
        return f"{self.storage.url}, leaf {leaf.name!r}"

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


def detach_lazy_tables(manifest: Manifest) -> None:
    """Every lazy table of `manifest` not fetched yet stops holding its finder: one fetch
    from then on fails (AttributeError). For a manifest whose readers are done."""
    for leaf in manifest.arrays:
        if isinstance(leaf.chunks, LazyChunkTable):
            leaf.chunks.__dict__.pop("_load", None)


def loaded_table(leaf: ArrayLeaf) -> ChunkTable | None:
    """The leaf's table if it is in memory (v1, or a v2 table already fetched)."""
    t = leaf.chunks
    return None if isinstance(t, LazyChunkTable) and "_load" in t.__dict__ else t
