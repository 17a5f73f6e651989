"""PyTorch DCP's storage writer over snapshard's format: `dcp.save` and `dcp.async_save`
write a snapshard checkpoint (format v2), atomically, with per-chunk checksums, on any
storage `storage_for` takes (local paths, s3://, gs://, az://, memory://).

How DCP's protocol maps onto snapshard's save:

- DCP's planner decides who writes what (its coordinator removes the copies of replicated
  items). `prepare_global_plan` (coordinator) numbers the leaves of the checkpoint's tree,
  built from the paths DCP's planner recorded when it flattened the state dict, and hands
  every rank the numbering and the name of the save's staging area in its plan.
- `write_data` (every rank): the rank writes its items into its own data files (chunk bytes
  and their crc32c, as snapshard.save writes them) and its record file, and returns its
  report (nonce, file sizes, record checksum, the plain values it holds) in its results.
- `finish` (coordinator): DCP has gathered every rank's results; the coordinator builds the
  manifest (one explicit layout per tensor: DCP's chunks and the rank that wrote each),
  checks it and the staged files against the reports, and commits (rename, or the commit
  marker written last). Nothing is visible before; a failed or killed save leaves no
  checkpoint.

Non-tensor state (DCP's `BYTE_IO` items, which DCP pickles): a Python `int`, `float`,
`bool`, `str` or `None` is stored as a value in the manifest, no pickle involved (taken
from the default planner's `lookup_object`); anything else is stored as the bytes DCP's
planner made of it (`torch.save`), an opaque `uint8` array leaf listed in the manifest's
`extra["dcp"]["pickled"]`. snapshard's own loaders never unpickle it; `dcp.load` through
snapshard.torch.StorageReader hands it to DCP's planner, which unpickles it as DCP does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import write_tuning
from ..checksum import crc32c
from ..coordination.rendezvous import Rendezvous, all_succeeded
from ..errors import CheckpointExistsError, SnapshardError
from ..format import (
    ArrayLeaf,
    Leaf,
    Manifest,
    ProcessTable,
    ValueLeaf,
    compression,
    encoding,
    record_file_name,
    records,
)
from ..format.binding import name_key
from ..format.layout_table import LayoutTable
from ..format.layouts import describe_rows
from ..format.values import decode_value, encode_value
from ..options import SaveOptions, require
from ..planning.layout import ArrayLayout
from ..saving import ChunkColumns, commit_manifest, staged_files, write_chunk_files
from ..saving.commit import remove_own
from ..staging import StagedItem
from ..storage import Location, Storage, is_object_store_url, storage_for
from ..tree import Path, flatten, path_str
from .coordination import default_coordinator
from .dtypes import host_view, numpy_dtype

PICKLED_KEY = "dcp"  # manifest extra: {"pickled": [leaf names stored as DCP's pickles]}
_REPORT = MetadataIndex("snapshard.report")  # the result of a rank that wrote no item
_PLAIN = (int, float, bool, str, type(None))


class DcpStorageError(SnapshardError):
    """DCP handed snapshard's storage writer or reader something it cannot store or read."""


@dataclass(frozen=True)
class DcpLeaf:
    """One leaf of a DCP save: its state dict name (fqn), path, and what is written."""

    fqn: str
    path: Path
    is_tensor: bool
    dtype: np.dtype  # uint8 for DCP's pickled bytes
    shape: tuple[int, ...]  # () for bytes: their length is known when they are written
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]]  # offsets, sizes, writer rank


@dataclass(frozen=True)
class SaveNumbering:
    """What every rank needs to write its share: the staging attempt and the leaf numbers
    (which its record file uses); travels to each rank in its plan's `storage_data`."""

    attempt: str
    rank: int
    numbers: dict[str, int]  # fqn -> leaf number
    ndims: list[int]


@dataclass
class RankReport:
    """What one rank wrote, gathered to the coordinator by DCP with its write results."""

    attempt: str
    rank: int
    nonce: str
    data_sizes: list[int]
    record_size: int
    record_crc: int
    values: dict[int, dict[str, Any]] = field(default_factory=dict)  # leaf -> encoded value
    pickled: dict[int, int] = field(default_factory=dict)  # leaf -> bytes written
    codecs: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Slot:
    """A leaf's place in the tree rebuilt from DCP's paths (flattened into the numbering)."""

    fqn: str


def _nested(paths: list[tuple[str, Path]], where: str) -> Any:
    """The state dict's shape rebuilt from the leaves' paths: dicts, and lists where the
    keys of a level are 0..n-1 (as DCP's unflattening makes them)."""

    def listed(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        kids = {k: listed(v) for k, v in node.items()}
        if kids and all(type(k) is int for k in kids) and sorted(kids) == list(range(len(kids))):
            return [kids[i] for i in range(len(kids))]
        return kids

    root: dict[Any, Any] = {}
    for fqn, path in paths:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise DcpStorageError(f"save to {where}: leaf {fqn!r} lies inside another leaf")
        if not path or path[-1] in node:
            raise DcpStorageError(f"save to {where}: leaf {fqn!r} has the path of another leaf")
        node[path[-1]] = _Slot(fqn)
    return listed(root)


def _path_of(fqn: str, mappings: Any) -> Path:
    """The state dict path DCP's planner recorded for `fqn` (its flattening), else the fqn
    itself as one key (a flat state dict)."""
    path = mappings.get(fqn) if isinstance(mappings, dict) else None
    if isinstance(path, tuple | list) and path:
        return tuple(k if isinstance(k, int) else str(k) for k in path)
    return (fqn,)


def _leaves_of(plans: list[SavePlan], where: str) -> dict[str, DcpLeaf]:
    """Every item of the global plan, as leaves: each tensor's chunks with their writers."""
    mappings: dict[str, Any] = {}
    for plan in plans:
        if isinstance(plan.planner_data, dict):
            mappings.update(plan.planner_data)
    found: dict[str, DcpLeaf] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            leaf = found.get(fqn)
            if leaf is None:
                leaf = found[fqn] = _new_leaf(item, _path_of(fqn, mappings), where)
            if item.tensor_data is not None:
                chunk = item.tensor_data.chunk
                leaf.chunks.append((tuple(chunk.offsets), tuple(chunk.sizes), rank))
            elif leaf.chunks:
                raise DcpStorageError(f"save to {where}: leaf {fqn!r} is written by two ranks")
            else:
                leaf.chunks.append(((0,), (0,), rank))
    return found


def _new_leaf(item: WriteItem, path: Path, where: str) -> DcpLeaf:
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        return DcpLeaf(fqn, path, False, np.dtype(np.uint8), (), [])
    if item.tensor_data is None:
        raise DcpStorageError(f"save to {where}: leaf {fqn!r}: a tensor item without its shape")
    dtype = numpy_dtype(item.tensor_data.properties.dtype, leaf=fqn)
    return DcpLeaf(fqn, path, True, dtype, tuple(item.tensor_data.size), [])


class StorageWriter(_DcpStorageWriter):
    """`torch.distributed.checkpoint.StorageWriter` that writes a snapshard checkpoint:
    `dcp.save(state, storage_writer=snapshard.torch.StorageWriter(path))`.

    `path`: a directory or object-store URL (or `checkpoint_id=` of `dcp.save`, which takes
    precedence). `options`: `writers` (data files per rank) and `compression` as in
    snapshard.save; who writes what is DCP's plan. Picklable (DCP's process-based async
    save sends it along); one writer serves any number of saves (DCP's `reset`).

    What is at `path` already: nothing, or an empty directory (DCP's tests and tutorials
    `mkdtemp` the path first), is written into. A snapshard checkpoint is replaced when
    `overwrite` (the default, as DCP's FileSystemWriter), atomically: the old checkpoint
    stays whole and readable until the new one commits in one rename (local) or one PUT of
    its manifest (object stores), and a save that fails leaves it as it was;
    `overwrite=False` refuses it with CheckpointExistsError. A directory of other files (a
    DCP checkpoint of FileSystemWriter's among them) is never replaced.

    DCP's plan caching (`DefaultSavePlanner(enable_plan_caching=True)`) is refused at the
    first save: a cached plan lacks the leaf numbering this writer puts in each plan.

    FileSystemWriter's keywords are taken too, so that switching the class is the whole
    change (see `filesystem_writer_options`)."""

    def __init__(
        self,
        path: Location | None = None,
        options: SaveOptions = SaveOptions(),
        *,
        overwrite: bool = True,
        **filesystem_writer_args: Any,
    ) -> None:
        super().__init__()
        require(options, SaveOptions)
        options = filesystem_writer_options(options, filesystem_writer_args)
        if options.hashes:
            raise ValueError("snapshard.torch.StorageWriter does not record content hashes")
        self.path = os.fspath(path) if path is not None else None
        self.options = options
        self.overwrite = overwrite
        self.is_coordinator = False
        self._leaves: dict[str, DcpLeaf] = {}
        self._structure: dict[str, Any] = {}
        self._attempt = ""

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._leaves, self._structure, self._attempt = {}, {}, ""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            storage_for(checkpoint_id).close()
        except (ValueError, SnapshardError, ImportError):
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=uuid.uuid4().hex)

    def _storage(self) -> Storage:
        if not self.path:
            raise ValueError(
                "snapshard.torch.StorageWriter needs a location: StorageWriter(path), or "
                "dcp.save(..., checkpoint_id=path)"
            )
        return storage_for(self.path)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if not self.overwrite:  # early, on every rank; the commit checks again, atomically
            with self._storage() as storage:
                if storage.is_committed():
                    raise CheckpointExistsError(
                        f"a checkpoint already exists at {storage.url} (pass "
                        "StorageWriter(..., overwrite=True) to replace it)"
                    )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        where = self.path or "?"
        if not all(getattr(p, "usable", True) for p in plans):  # a planner of the user's own
            raise plan_caching_refused(where)
        leaves = _leaves_of(plans, where)
        tree = _nested([(leaf.fqn, leaf.path) for leaf in leaves.values()], where)
        flat = flatten(tree, lambda x: isinstance(x, _Slot))
        order = [slot.fqn for slot in flat.leaves]
        self._leaves = {fqn: leaves[fqn] for fqn in order}
        self._structure = flat.structure
        self._attempt = uuid.uuid4().hex[:16]
        numbers = {fqn: i for i, fqn in enumerate(order)}
        ndims = [len(leaves[fqn].shape) if leaves[fqn].is_tensor else 1 for fqn in order]
        return [
            dataclasses.replace(plan, storage_data=SaveNumbering(self._attempt, r, numbers, ndims))
            for r, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        numbering = plan.storage_data
        if not isinstance(numbering, SaveNumbering):
            raise DcpStorageError(
                f"save to {self.path}: the plan carries no leaf numbering from "
                "snapshard.torch.StorageWriter.prepare_global_plan"
            )
        with self._storage() as storage:
            storage.set_attempt(numbering.attempt)
            writer = _RankWriter(storage, numbering, self.options)
            error: BaseException | None = None
            try:
                _refuse_plan_caching(planner, storage.url)
                storage.prepare_staging()
                report = writer.write(plan.items, planner)
            except Exception as e:  # told to every rank below, then raised
                error = e
            try:
                _all_written(numbering.attempt, storage.url, self.options.timeout_s, error)
            except BaseException:
                writer.discard()  # every rank removes its files: DCP calls nothing after
                raise
        results = [
            WriteResult(item.index, writer.sizes.get(item.index.fqn, 0), report)
            for item in plan.items
        ] or [WriteResult(_REPORT, 0, report)]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with self._storage() as storage:
            storage.set_attempt(self._attempt)
            try:
                reports = _reports(results, self._attempt, storage.url)
                manifest, table = _manifest(self._structure, list(self._leaves.values()), reports)
                commit_manifest(storage, manifest, staged_files(table), overwrite=self.overwrite)
            except BaseException:
                storage.discard_staging()  # every rank has written: none of it is wanted now
                raise


def plan_caching_refused(where: str) -> DcpStorageError:
    """The one refusal of DCP's plan caching, at the first save or at a reused plan."""
    return DcpStorageError(
        f"save to {where}: DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)) "
        "reuses the plans of an earlier save, which lack the leaf numbering "
        "snapshard.torch.StorageWriter puts in each; pass a planner without it "
        "(DefaultSavePlanner(), the default)"
    )


def _refuse_plan_caching(planner: SavePlanner, where: str) -> None:
    """Refuse a planner that caches plans at its first save, where its plans are still whole
    (the coordinator only sees the reused plans from the second save on); write_data is the
    first call that is handed the planner, and every rank learns of the refusal there."""
    if getattr(planner, "_enable_plan_caching", False):
        raise plan_caching_refused(where)


# FileSystemWriter's keywords that choose how its own files are laid out, synced or staged:
# snapshard's format, fsync before the commit and DCP's default stager are fixed, so they
# change nothing here.
_LAYOUT_ARGS = frozenset(
    {"single_file_per_rank", "sync_files", "per_thread_copy_ahead", "cache_staged_state_dict",
     "serialization_format"}
)  # fmt: skip


def filesystem_writer_options(options: SaveOptions, args: dict[str, Any]) -> SaveOptions:
    """`options` with FileSystemWriter's keywords applied: `thread_count` is the number of
    data files (one writer thread each) this rank writes, where `options.writers` is unset;
    `_extensions=[ZStandard()]` is zstd compression; another stream extension (a transform
    of FileSystemWriter's files, an encryption perhaps) is refused rather than left out.
    The keywords in _LAYOUT_ARGS are accepted and change nothing; any other is a TypeError."""
    unknown = sorted(set(args) - _LAYOUT_ARGS - {"thread_count", "_extensions"})
    if unknown:
        raise TypeError(f"snapshard.torch.StorageWriter got unexpected keyword(s) {unknown}")
    threads = args.get("thread_count")
    if threads is not None and options.writers is None:
        options = dataclasses.replace(options, writers=int(threads))
    for ext in args.get("_extensions") or ():
        named = getattr(ext, "registry_name", None)
        name = named() if callable(named) else type(ext).__name__
        if name != "stream.zstd":
            raise ValueError(
                f"snapshard.torch.StorageWriter cannot apply DCP's stream extension {name!r} "
                "(it transforms FileSystemWriter's files); snapshard writes its own format, "
                "compressed with SaveOptions(compression='zstd')"
            )
        if options.compression is None:
            options = dataclasses.replace(options, compression="zstd")
    return options


class _RankWriter:
    """One rank's share of a DCP save: its data files, its record file and its report."""

    def __init__(self, storage: Storage, numbering: SaveNumbering, options: SaveOptions):
        self.storage, self.numbering, self.options = storage, numbering, options
        self.nonce = uuid.uuid4().hex[:8]
        self.sizes: dict[str, int] = {}

    def write(self, items: list[WriteItem], planner: SavePlanner) -> RankReport:
        report = RankReport(self.numbering.attempt, self.numbering.rank, self.nonce, [], 0, 0)
        staged = [s for item in items if (s := self._stage(item, planner, report)) is not None]
        url = self.storage.url
        tuner = None
        count = self.options.writers
        if count is None:
            tuner = write_tuning.counts_for(url, is_object_store_url(url))
            count = tuner.choose(sum(s.nbytes for s in staged))
        t0 = time.perf_counter()
        files = write_chunk_files(self.storage, self.numbering.rank, self.nonce, staged, count,
                                  self._codec_of(staged))  # fmt: skip
        if tuner is not None:
            tuner.record(count, sum(s.nbytes for s in staged), time.perf_counter() - t0)
        report.data_sizes = [f.size for f in files]
        chunks = ChunkColumns.of(files, [])
        codec = records.codecs_of(chunks.fixed["flags"])
        report.codecs = sorted(set(codec[codec != 0].tolist()))
        data = self._records(chunks)
        self.storage.write_bytes(record_file_name(self.numbering.rank, self.nonce), data)
        report.record_size, report.record_crc = len(data), crc32c(data)
        return report

    def _codec_of(self, staged: list[StagedItem]) -> Callable[[StagedItem], int] | None:
        option = self.options.compression
        if option is None:
            return None
        if not compression.available():
            raise SnapshardError("compression needs zstd: install snapshard[compress]")
        dtypes = {s.leaf: s.host.dtype for s in staged if s.host is not None}
        return lambda s: encoding.codec_for(option, dtypes[s.leaf])

    def _stage(
        self, item: WriteItem, planner: SavePlanner, report: RankReport
    ) -> StagedItem | None:
        """The item's bytes on the host (None: nothing to write: a plain value, which goes
        into the report, or a chunk without elements)."""
        fqn = item.index.fqn
        number = self.numbering.numbers.get(fqn)
        if number is None:
            raise DcpStorageError(f"save to {self.storage.url}: leaf {fqn!r} was not planned")
        if item.type == WriteItemType.BYTE_IO:
            lookup = getattr(planner, "lookup_object", None)
            obj = lookup(item.index) if lookup is not None else None
            if lookup is not None and type(obj) in _PLAIN:
                report.values[number] = encode_value(obj, fqn)
                return None
            raw = planner.resolve_data(item)
            data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
            report.pickled[number] = len(data)
            host = np.frombuffer(data, np.uint8)
            start, stop = np.zeros(1, np.int64), np.asarray([len(data)], np.int64)
        else:
            assert item.tensor_data is not None
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise DcpStorageError(f"save to {self.storage.url}: leaf {fqn!r}: no tensor")
            host = host_view(tensor.detach().cpu())
            start = np.asarray(tuple(item.tensor_data.chunk.offsets), np.int64)
            stop = start + np.asarray(tuple(item.tensor_data.chunk.sizes), np.int64)
        self.sizes[fqn] = host.nbytes
        if host.size == 0:
            return None
        return StagedItem(number, fqn, start, stop, host.nbytes, host=host)

    def _records(self, chunks: ChunkColumns) -> bytes:
        ndims = self.numbering.ndims
        segments = chunks.segments(ndims)
        digests = np.zeros(len(ndims), records.DIGEST)  # DCP's plan is global: nothing to compare
        salt = name_key(record_file_name(self.numbering.rank, self.nonce))
        return records.encode(self.numbering.rank, ndims, segments, digests, salt=salt)

    def discard(self) -> None:
        """This rank's files of a save that failed here (best effort: its error matters)."""
        with contextlib.suppress(SnapshardError):
            remove_own(self.storage, self.numbering.rank, self.nonce, settled=True)


def _all_written(attempt: str, url: str, timeout_s: float, error: BaseException | None) -> None:
    """Every rank learns whether every rank wrote its share (one rendezvous through the
    process group's store, under the save's attempt); raises on all of them, naming the
    rank, when one did not: DCP calls nothing after a failed write, so each rank removes
    its own staged files then."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    rv = Rendezvous(
        default_coordinator(), f"snapshard/dcp-save/{attempt}", f"save to {url}", timeout_s
    )
    try:
        all_succeeded(rv, "write", error)
    except BaseException:
        if error is not None:
            raise error from None  # this rank's own error says more than the relayed one
        raise


def _reports(results: list[list[WriteResult]], attempt: str, url: str) -> list[RankReport]:
    reports = []
    for rank, rank_results in enumerate(results):
        report = rank_results[0].storage_data if rank_results else None
        if not isinstance(report, RankReport) or report.attempt != attempt or report.rank != rank:
            raise DcpStorageError(
                f"save to {url}: rank {rank} sent no report of this save with its write results"
            )
        reports.append(report)
    return reports


def _manifest(
    structure: dict[str, Any], leaves: list[DcpLeaf], reports: list[RankReport]
) -> tuple[Manifest, ProcessTable]:
    """The checkpoint's manifest: per tensor one explicit layout (DCP's chunks, each held by
    the rank that wrote it); plain values inline; DCP's pickled bytes as uint8 arrays."""
    values = {i: v for r in reports for i, v in r.values.items()}
    pickled = {i: (n, r.rank) for r in reports for i, n in r.pickled.items()}
    table = LayoutTable()
    out: list[Leaf] = []
    for i, leaf in enumerate(leaves):
        if i in values:
            out.append(ValueLeaf(leaf.path, decode_value(values[i], leaf.fqn)))
            continue
        if leaf.is_tensor:
            shape, chunks, kind = leaf.shape, leaf.chunks, "dcp"
        elif i in pickled:
            shape, chunks = (pickled[i][0],), [((0,), (pickled[i][0],), pickled[i][1])]
            kind = "dcp pickle"  # what `snapshard info` shows for it
        else:
            raise DcpStorageError(f"leaf {leaf.fqn!r}: no rank reported writing it")
        lid = table.layout(describe_rows(_layout(shape, leaf.dtype.itemsize, chunks)))
        count = sum(1 for _, sizes, _ in chunks if math.prod(sizes) > 0)
        out.append(
            ArrayLeaf(
                leaf.path, "array", leaf.dtype.name, shape, {"type": kind, "chunks": len(chunks)},
                layout=lid, chunk_count=count,
            )
        )  # fmt: skip
    processes = ProcessTable(
        nonces=[r.nonce for r in reports],
        data_sizes=[r.data_sizes for r in reports],
        record_sizes=[r.record_size for r in reports],
        record_crcs=[r.record_crc for r in reports],
    )
    names = [path_str(leaves[i].path) for i in sorted(pickled)]
    manifest = Manifest.of_processes(
        processes, structure, out, write_mode="single_replica", layouts=table.layouts,
        extra={PICKLED_KEY: {"pickled": names}} if names else {},
        codecs=[records.CODECS[c] for c in sorted({c for r in reports for c in r.codecs})],
    )  # fmt: skip
    return manifest, processes


def _layout(
    shape: tuple[int, ...],
    itemsize: int,
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]],
) -> ArrayLayout:
    """DCP's chunks of one array as a layout: each box held by the rank that wrote it."""
    nd = len(shape)
    starts = np.asarray([c[0] for c in chunks], np.int64).reshape(len(chunks), nd)
    stops = starts + np.asarray([c[1] for c in chunks], np.int64).reshape(len(chunks), nd)
    ranks = np.asarray([c[2] for c in chunks], np.int64)
    return ArrayLayout(shape, itemsize, starts, stops, np.zeros(len(chunks), np.int64), ranks)
