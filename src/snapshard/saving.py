"""The save executor: plan, stage the owned slices on the host, write, then commit.

Blocking phase (the caller waits): flatten the tree, plan (cached), start the host copies of
every owned slice and wait for them. Nothing else.

Background phase: every process writes its own data files and index with no coordination,
reports "written" through the coordinator, and process 0 merges the indexes into the
manifest, validates it, removes stale files, and commits; every process learns the outcome.
Synchronisation points per save: one rendezvous after writing (process 0 waits for every
process's report) and one outcome broadcast. See docs/design.md.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .adapters.leaves import SaveArray, classify, is_save_leaf
from .background import BackgroundTask
from .checksum import block_crcs, crcs_to_hex
from .coordination import Coordinator, default_coordinator
from .coordination.rendezvous import Rendezvous, namespace
from .errors import CheckpointExistsError, CoordinationError
from .format import (
    DATA_DIR,
    INDEX_DIR,
    ArrayLeaf,
    ChunkTable,
    FileEntry,
    Leaf,
    Manifest,
    ProcessIndex,
    ValueLeaf,
    checksum_block,
    validate_coverage,
    validate_structure,
)
from .planning import WritePlan, plan_writes
from .staging import Snapshot, StagedItem, stage
from .storage import FileWriter, Location, Storage, storage_for
from .tree import FlatTree, Path, flatten

log = logging.getLogger("snapshard")

DEFAULT_TIMEOUT_S = 600.0
_WRITE_PIECE = 16 << 20


@dataclass
class SaveTimings:
    """Seconds spent in each phase of one save, as seen by this process."""

    plan_s: float = 0.0
    stage_s: float = 0.0  # device-to-host copies: the blocking phase ends here
    write_s: float = 0.0  # data files and index, fsynced
    commit_s: float = 0.0  # waiting for the others, merge, validate, commit (process 0)
    blocking_s: float = 0.0
    total_s: float = 0.0
    bytes_written: int = 0
    bytes_staged: int = 0  # host bytes copied in the blocking phase (0: zero-copy views)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Prepared:
    storage: Storage
    rendezvous: Rendezvous
    leaves: list[Leaf | SaveArray]
    structure: dict[str, Any]
    plan: WritePlan
    items: list[StagedItem]
    overwrite: bool
    threads: int
    extra: dict[str, Any]
    timings: SaveTimings = field(default_factory=SaveTimings)


class SaveAdapter(Protocol):
    """Hook for a framework other than JAX (snapshard.torch): which values are leaves, how
    they become SaveArrays, and how this process's planned items reach host memory."""

    def is_leaf(self, x: Any) -> bool: ...

    def classify(self, path: Path, value: Any, process_count: int) -> Leaf | SaveArray: ...

    def stage(
        self, arrays: list[tuple[int, SaveArray]], plan: WritePlan, process: int, *, copy: bool
    ) -> tuple[list[StagedItem], int]: ...


def classify_leaves(flat: FlatTree, process_count: int) -> list[Leaf | SaveArray]:
    return [classify(p, v, process_count) for p, v in zip(flat.paths, flat.leaves, strict=True)]


def prepare(
    location: Location | Storage,
    tree: Any,
    *,
    overwrite: bool = False,
    mode: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    coordinator: Coordinator | None = None,
    threads: int = 2,
    copy_host_values: bool = False,
    host_budget: int | None = None,
    extra: dict[str, Any] | None = None,
    snapshot: Snapshot | None = None,
    flat: FlatTree | None = None,
    adapter: SaveAdapter | None = None,
) -> _Prepared:
    """The blocking phase: plan, then bring every owned slice to host memory (from
    `snapshot`, the host copy of the tree's device arrays, when one was already made)."""
    t0 = time.perf_counter()
    coord = coordinator or default_coordinator()
    storage = storage_for(location)
    flat = flat or flatten(tree, adapter.is_leaf if adapter else is_save_leaf)
    if adapter is not None:
        n = coord.process_count
        leaves = [adapter.classify(p, v, n) for p, v in zip(flat.paths, flat.leaves, strict=True)]
    else:
        leaves = classify_leaves(flat, coord.process_count)
    arrays = [(i, leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, SaveArray)]
    plan = plan_writes([a.layout for _, a in arrays], mode, num_processes=coord.process_count)
    t1 = time.perf_counter()
    if adapter is not None:
        items, copied = adapter.stage(arrays, plan, coord.process_index, copy=copy_host_values)
    else:
        items, copied = stage(
            arrays,
            plan,
            coord.process_index,
            budget=host_budget,
            copy_host_values=copy_host_values,
            snapshot=snapshot,
        )
    t2 = time.perf_counter()
    timings = SaveTimings(plan_s=t1 - t0, stage_s=t2 - t1, blocking_s=t2 - t0, bytes_staged=copied)
    # The namespace is taken here, in program order, the same on every process.
    rv = Rendezvous(coord, namespace("save", storage.url), f"save to {storage.url}", timeout_s)
    return _Prepared(
        storage, rv, leaves, flat.structure, plan, items, overwrite, threads, extra or {}, timings
    )


def _split_files(items: list[StagedItem], n: int) -> list[list[StagedItem]]:
    """Items into n files of nearly equal size (largest first, each to the lightest file)."""
    n = max(1, min(n, len(items)))
    files: list[list[StagedItem]] = [[] for _ in range(n)]
    load = [0] * n
    for it in sorted(items, key=lambda it: -it.nbytes):
        j = load.index(min(load))
        files[j].append(it)
        load[j] += it.nbytes
    return [f for f in files if f]


def write_chunk(
    writer: FileWriter, data: np.ndarray, start: Any, stop: Any, file: int, offset: int
) -> dict[str, Any]:
    """Append the C-order bytes of box [start, stop) to `writer`, checksumming each block as
    it goes out; returns the chunk's manifest row (its offset in the file given)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    block = checksum_block(len(raw))
    piece = max(block, (_WRITE_PIECE // block) * block)
    crcs: list[int] = []
    for a in range(0, len(raw), piece):
        crcs.extend(block_crcs(raw[a : a + piece], block))
        writer.write(raw[a : a + piece])
    return {
        "start": [int(x) for x in start],
        "stop": [int(x) for x in stop],
        "file": file,
        "offset": offset,
        "nbytes": len(raw),
        "block": block,
        "crc32c": crcs_to_hex(crcs),
    }


def _write_file(
    storage: Storage, name: str, items: list[StagedItem]
) -> tuple[int, list[tuple[int, dict[str, Any]]]]:
    """Write items back to back into one file; returns its size and the chunk rows."""
    writer = storage.open_writer(name)
    rows = []
    offset = 0
    try:
        for it in items:
            rows.append(
                (it.leaf, write_chunk(writer, it.materialize(), it.start, it.stop, 0, offset))
            )
            it.release()  # the bytes are in the file now: let the host copy go
            offset += it.nbytes
        size = writer.close()
    except BaseException:
        writer.abort()
        raise
    return size, rows


def _write_own(prep: _Prepared) -> str:
    """Write this process's data files and its index; returns the index file name."""
    pid = prep.rendezvous.coord.process_index
    nonce = uuid.uuid4().hex[:8]
    prep.storage.prepare_staging()
    groups = _split_files(prep.items, prep.threads)
    names = [f"{DATA_DIR}/p{pid:05d}-{nonce}-{j}.bin" for j in range(len(groups))]
    if len(groups) > 1:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="snapshard-write") as pool:
            results = list(
                pool.map(lambda a: _write_file(prep.storage, *a), zip(names, groups, strict=True))
            )
    else:
        results = [_write_file(prep.storage, n, g) for n, g in zip(names, groups, strict=True)]
    files = [FileEntry(n, size) for n, (size, _) in zip(names, results, strict=True)]
    by_leaf: dict[int, list[dict[str, Any]]] = {}
    for j, (_, rows) in enumerate(results):
        for leaf, row in rows:
            row["file"] = j
            by_leaf.setdefault(leaf, []).append(row)
    ndims = {
        i: len(leaf.shape) for i, leaf in enumerate(prep.leaves) if isinstance(leaf, SaveArray)
    }
    index = ProcessIndex(
        pid,
        files,
        {i: ChunkTable.from_rows(r, ndims[i], f"process {pid}") for i, r in by_leaf.items()},
    )
    name = f"{INDEX_DIR}/p{pid:05d}-{nonce}.json"
    prep.storage.write_bytes(name, index.to_json())
    prep.timings.bytes_written = sum(f.size for f in files)
    return name


def _merge(prep: _Prepared, index_names: list[str]) -> Manifest:
    url = prep.storage.url
    ndims = {
        i: len(leaf.shape) for i, leaf in enumerate(prep.leaves) if isinstance(leaf, SaveArray)
    }
    files: list[FileEntry] = []
    tables: dict[int, list[ChunkTable]] = {}
    for name in index_names:
        idx = ProcessIndex.from_json(prep.storage.read_staging(name), f"{url}/{name}", ndims)
        base = len(files)
        files.extend(idx.files)
        for leaf_index, t in idx.chunks.items():
            t.file = t.file + base
            tables.setdefault(leaf_index, []).append(t)
    out: list[Leaf] = []
    for i, leaf in enumerate(prep.leaves):
        if isinstance(leaf, SaveArray):
            out.append(
                ArrayLeaf(
                    leaf.path,
                    leaf.kind,
                    leaf.dtype.name,
                    leaf.shape,
                    leaf.sharding,
                    leaf.key_impl,
                    ChunkTable.concat(tables.get(i, []), len(leaf.shape)).sorted_by_box(),
                )
            )
        else:
            assert isinstance(leaf, ValueLeaf)
            out.append(leaf)
    return Manifest(
        structure=prep.structure,
        leaves=out,
        files=files,
        process_count=prep.rendezvous.coord.process_count,
        write_mode=prep.plan.mode,
        extra={**prep.extra, "indexes": index_names},
    )


def _check_staged_files(prep: _Prepared, manifest: Manifest, index_names: list[str]) -> None:
    """Files on storage are exactly those of this save, with the sizes the indexes claim.

    Files of an earlier attempt that died (other nonces) are removed first.
    """
    expected = {f.name: f.size for f in manifest.files}
    listing = prep.storage.list_staging()
    stale = [n for n in listing if n not in expected and n not in index_names]
    if stale:
        log.warning(
            "save to %s: removing %d stale file(s) of an earlier attempt",
            prep.storage.url,
            len(stale),
        )
        prep.storage.delete_staging_files(stale)
    for name, size in expected.items():
        if listing.get(name) != size:
            raise CoordinationError(
                f"save to {prep.storage.url}: file {name!r} has {listing.get(name)} bytes on storage, its index says {size}"
            )


def finish(prep: _Prepared) -> SaveTimings:
    """The background phase. Raises on this process if the save failed anywhere."""
    t0 = time.perf_counter()
    rv = prep.rendezvous
    pid = rv.coord.process_index

    def fail(e: BaseException) -> None:
        """Process 0: tell everyone, and remove what was staged (nothing was visible)."""
        rv.publish_outcome(e)
        log.error("%s failed: %s", rv.what, e)
        prep.storage.discard_staging()

    try:
        index_name = _write_own(prep)
    except BaseException as e:
        rv.report(f"written/{pid}", e)
        if rv.coord.is_leader:
            fail(e)
        raise
    rv.report(f"written/{pid}", index=index_name)
    t1 = time.perf_counter()
    prep.timings.write_s = t1 - t0
    rv.start_clock()
    if rv.coord.is_leader:
        try:
            others = rv.gather("written")
            index_names = [
                index_name if p == pid else others[p]["index"]
                for p in range(rv.coord.process_count)
            ]
            manifest = _merge(prep, index_names)
            where = prep.storage.url
            validate_structure(manifest, where)
            validate_coverage(manifest, where)
            _check_staged_files(prep, manifest, index_names)
            prep.storage.commit(manifest.to_json(), overwrite=prep.overwrite)
        except BaseException as e:
            fail(e)
            raise
        rv.publish_outcome()
    else:
        rv.await_outcome()
    t2 = time.perf_counter()
    prep.timings.commit_s = t2 - t1
    prep.timings.total_s = prep.timings.blocking_s + (t2 - t0)
    return prep.timings


def save(
    directory: Location | Storage,
    tree: Any,
    *,
    overwrite: bool = False,
    mode: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    coordinator: Coordinator | None = None,
    threads: int = 2,
) -> SaveTimings:
    """Save `tree` to `directory`, atomically: the checkpoint appears whole or not at all.

    Every process of a multi-process job calls this with the same tree; each writes only the
    slices the shared plan gives it. `mode` is the write mode (see planning.write_plan);
    `threads` the number of data files each process writes in parallel.
    """
    storage = storage_for(directory)
    if not overwrite and storage.is_committed():
        raise CheckpointExistsError(
            f"a checkpoint already exists at {storage.url} (pass overwrite=True to replace it)"
        )
    prep = prepare(
        storage,
        tree,
        overwrite=overwrite,
        mode=mode,
        timeout_s=timeout_s,
        coordinator=coordinator,
        threads=threads,
    )
    return finish(prep)


class AsyncSave(BackgroundTask[SaveTimings]):
    """A save whose background phase is running: `wait()` returns its timings or raises."""

    def __init__(self, prep: _Prepared):
        self._prep = prep
        super().__init__(lambda: finish(prep), f"save to {prep.storage.url}")

    @property
    def location(self) -> str:
        return self._prep.storage.url

    @property
    def timings(self) -> SaveTimings:
        """Per-phase durations; the background ones are filled in when the save is done."""
        return self._prep.timings


def save_async(
    directory: Location | Storage,
    tree: Any,
    *,
    overwrite: bool = False,
    mode: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    coordinator: Coordinator | None = None,
    threads: int = 2,
    host_budget: int | None = None,
    extra: dict[str, Any] | None = None,
) -> AsyncSave:
    """Start a save and return once every owned slice is on the host.

    The caller may then change or donate its arrays (see staging.py for the rule when
    `host_budget` is smaller than the bytes this process owns). Writing, syncing, merging,
    validating and committing run in the background. An existing checkpoint at the location
    is detected at commit, without blocking here.
    """
    prep = prepare(
        directory,
        tree,
        overwrite=overwrite,
        mode=mode,
        timeout_s=timeout_s,
        coordinator=coordinator,
        threads=threads,
        copy_host_values=True,
        host_budget=host_budget,
        extra=extra,
    )
    return AsyncSave(prep)
