"""PyTorch DCP's storage writer over snapshard's format: `dcp.save` and `dcp.async_save`
write a snapshard checkpoint (format v2), atomically, with per-chunk checksums, on any
storage `storage_for` takes (local paths, s3://, gs://, az://, memory://).

How DCP's protocol maps onto snapshard's save:

- DCP's planner decides who writes what (its coordinator removes the copies of replicated
  items). `prepare_global_plan` (coordinator) numbers the leaves of the checkpoint's tree,
  built from the paths DCP's planner recorded when it flattened the state dict
  (torch/dcp_manifest.py), and hands every rank the numbering and the name of the save's
  staging area in its plan.
- `write_data` (every rank): the rank writes its items into its own data files (chunk bytes
  and their crc32c, as snapshard.save writes them) and its record file
  (torch/dcp_rank_writer.py), and returns its report (nonce, file sizes, record checksum,
  the plain values it holds) in its results.
- `finish` (coordinator): DCP has gathered every rank's results; the coordinator builds the
  manifest (one explicit layout per tensor: DCP's chunks and the rank that wrote each),
  checks it and the staged files against the reports, and commits (rename, or the commit
  marker written last). Nothing is visible before; a failed or killed save leaves no
  checkpoint.

Non-tensor state is stored as torch/dcp_manifest.py says.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter as _DcpStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..coordination.rendezvous import Rendezvous, all_succeeded
from ..errors import CheckpointExistsError, SnapshardError
from ..options import SaveOptions, require
from ..saving import commit_manifest, staged_files
from ..storage import Location, Storage, storage_for
from .coordination import TorchStoreCoordinator
from .dcp_manifest import DcpLeaf, DcpStorageError, RankReport, manifest_of, numbered_leaves
from .dcp_rank_writer import RankWriter, SaveNumbering

_REPORT = MetadataIndex("snapshard.report")  # the result of a rank that wrote no item


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
        self._leaves, self._structure = numbered_leaves(plans, where)
        self._attempt = uuid.uuid4().hex[:16]
        numbers = {fqn: i for i, fqn in enumerate(self._leaves)}
        ndims = [len(leaf.shape) if leaf.is_tensor else 1 for leaf in self._leaves.values()]
        return [
            dataclasses.replace(
                plan, storage_data=SaveNumbering(self._attempt, r, numbers, ndims, len(plans))
            )
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
            writer = RankWriter(storage, numbering, self.options)
            error: BaseException | None = None
            try:
                _refuse_plan_caching(planner, storage.url)
                storage.prepare_staging()
                report = writer.write(plan.items, planner)
            except Exception as e:  # told to every rank below, then raised
                error = e
            try:
                _all_written(numbering, storage.url, self.options.timeout_s, error)
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
                manifest, table = manifest_of(self._structure, list(self._leaves.values()), reports)
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


def _all_written(
    numbering: SaveNumbering, url: str, timeout_s: float, error: BaseException | None
) -> None:
    """Every rank of the save (DCP's process group: a subgroup, or this rank alone with
    `no_dist`) learns whether every rank wrote its share (one rendezvous through the default
    group's store, under the save's attempt); raises on all of them, naming the rank, when
    one did not: DCP calls nothing after a failed write, so each rank removes its own
    staged files then."""
    if numbering.ranks == 1:
        if error is not None:
            raise error
        return
    coord = TorchStoreCoordinator(rank=numbering.rank, world_size=numbering.ranks)
    rv = Rendezvous(coord, f"snapshard/dcp-save/{numbering.attempt}", f"save to {url}", timeout_s)
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
