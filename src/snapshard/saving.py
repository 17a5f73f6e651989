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

import json
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from . import per_process, tree_union, write_tuning
from .background import BackgroundTask
from .checksum import crc32c
from .chunk_files import FileChunks, cut_files, files_at_once, write_files
from .coordination import Coordinator, default_coordinator
from .coordination.rendezvous import (
    Rendezvous,
    namespace,
    report_early_failure,
    write_then_commit,
)
from .errors import (
    CheckpointExistsError,
    CoordinationError,
    CorruptCheckpointError,
    SnapshardError,
)
from .format import (
    ArrayLeaf,
    ChunkTable,
    Leaf,
    Manifest,
    ProcessTable,
    ValueLeaf,
    compression,
    data_file_name,
    encoding,
    record_file_name,
    records,
    validate_structure,
)
from .format.binding import name_key
from .format.encoding import chunk_span as chunk_span  # for box_writer.py, as before
from .format.encoding import write_chunk as write_chunk  # for box_writer.py, as before
from .format.layouts import Mesh, describe_rows, mesh_layout, same_holders
from .format.leaves import leaf_from_json, leaf_to_json
from .format.manifest import PerProcessLeaf, encode_value, values_file_name
from .format.naming import tree_file_name
from .format.records import RECORD_FIXED, ChunkRecord, ProcessReport
from .format.records import records_of as records_of  # for box_writer.py, as before
from .frameworks import default_save_adapter
from .gc_pause import Frozen, collection_paused
from .incremental import Increment, check_refs_committed, manifest_refs
from .options import SaveOptions, require
from .planning import WritePlan, plan_writes
from .planning.write_plan import plan_by_holders
from .save_leaves import MeshSpec, SaveArray, checked_dtype
from .staging import Snapshot, StagedItem
from .storage import Location, Storage, is_object_store_url, storage_for
from .storage.stale_staging import is_owner_record
from .tree import FlatTree, Path, flatten

log = logging.getLogger("snapshard")

WrittenFile = tuple[int, list[tuple[int, ChunkRecord]]]
"""A data file just written: its size, and the (leaf, record) of each chunk in it."""


@dataclass
class SaveTimings:
    """Seconds spent in each phase of one save, as seen by this process."""

    plan_s: float = 0.0
    stage_s: float = 0.0  # device-to-host copies: the blocking phase ends here
    write_s: float = 0.0  # data files and index, fsynced
    commit_s: float = 0.0  # waiting for the others, merge, validate, commit (process 0)
    blocking_s: float = 0.0
    total_s: float = 0.0
    bytes_written: int = 0  # array bytes written by this process (before compression)
    bytes_metadata: int = 0  # what it wrote beside them: checksum tables, chunk records
    bytes_stored: int = 0  # all it put on storage: data files (compressed), records, values
    bytes_staged: int = 0  # host bytes copied in the blocking phase (0: zero-copy views)
    data_files: int = 0  # data files this process wrote (in parallel)

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
    options: SaveOptions
    extra: dict[str, Any]
    digests: np.ndarray  # format.records.DIGEST per leaf
    timings: SaveTimings = field(default_factory=SaveTimings)
    increment: Increment | None = None  # content hashes and references (incremental.py)
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # this attempt's files
    adapter: SaveAdapter = field(default_factory=default_save_adapter)


class SaveAdapter(Protocol):
    """What a framework's wing supplies to the save executor (jax/save_adapter.py for JAX,
    torch/saving.py for PyTorch): which values are leaves, how they become SaveArrays, how
    this process's planned items reach host memory, an array's mesh for the manifest's
    compact layouts, and what to give back once the save has ended. `trees_differ`: whether
    its leaves were classified for a tree that may differ by process (SaveOptions.trees_differ:
    host values held by this process alone, sub-meshes not widened)."""

    trees_differ: bool

    def is_leaf(self, x: Any) -> bool: ...

    def classify(self, path: Path, value: Any, process_count: int) -> Leaf | SaveArray: ...

    def stage(
        self, arrays: list[tuple[int, SaveArray]], plan: WritePlan, process: int, *, copy: bool
    ) -> tuple[list[StagedItem], int]:
        """This process's items of `plan` on the host, and the host bytes copied for them;
        `copy`: the caller goes on before the items are written (save_async)."""
        ...

    def mesh_of(self, arr: SaveArray) -> MeshSpec | None:
        """The array's device mesh and partition spec where it has one (None: rows)."""
        ...

    def release(self) -> None:
        """Called once the save has ended, however it ended (reused host buffers go back)."""
        ...


class ReplicatedSource:
    """Base of a framework's source of an array that may be assumed equal on every process
    (a plain torch tensor): its value's digest is compared at commit, as a NumPy leaf's is;
    0 where the source is sharded (each process holds its own part). A base class, not a
    runtime-checked Protocol: the check runs once per leaf of every save (5 us against
    0.1 us)."""

    def value_digest(self) -> int:
        raise NotImplementedError


def classify_leaves(
    flat: FlatTree, process_count: int, adapter: SaveAdapter | None = None
) -> list[Leaf | SaveArray]:
    """Every leaf of `flat` as a SaveArray or a manifest leaf (JAX's adapter by default)."""
    classify = (adapter or default_save_adapter()).classify
    return [classify(p, v, process_count) for p, v in zip(flat.paths, flat.leaves, strict=True)]


@collection_paused()
def prepare(
    location: Location | Storage,
    tree: Any,
    options: SaveOptions = SaveOptions(),
    *,
    overwrite: bool = False,
    coordinator: Coordinator | None = None,
    asynchronous: bool = False,
    extra: dict[str, Any] | None = None,
    snapshot: Snapshot | None = None,
    flat: FlatTree | None = None,
    adapter: SaveAdapter | None = None,
    base: Location | Storage | None = None,
    identical: frozenset[int] = frozenset(),
) -> _Prepared:
    """The blocking phase: plan, then bring every owned slice to host memory through
    `adapter`, the framework's wing (None: JAX's, which stages from `snapshot`, the host copy
    of the tree's device arrays, when one was already made; other adapters ignore it).
    `asynchronous`: the caller goes on before `finish` writes the bytes (save_async, the
    manager), so staging must not depend on the tree staying as it is (staging.stage)."""
    t0 = time.perf_counter()
    require(options, SaveOptions)
    if adapter is None:
        adapter = default_save_adapter(options.host_budget, snapshot)
    if not isinstance(location, Storage) and not os.fspath(location):
        raise ValueError("the checkpoint location is empty")
    coord = coordinator or default_coordinator()
    storage = storage_for(location)
    # The namespace is taken here, in program order, the same on every process.
    rv = Rendezvous(
        coord, namespace("save", storage.url), f"save to {storage.url}", options.timeout_s
    )
    try:
        return _prepare(
            rv, storage, tree, options, overwrite=overwrite, asynchronous=asynchronous,
            extra=extra, flat=flat, adapter=adapter, base=base, identical=identical, t0=t0,
        )  # fmt: skip
    except BaseException as e:
        cause = report_early_failure(rv, e)  # the others fail at once, naming this error
        if cause is not None:  # process 0 failed the save first: its error is the cause
            storage.discard_staging_if_empty()
            raise cause from e
        raise


def _prepare(
    rv: Rendezvous,
    storage: Storage,
    tree: Any,
    options: SaveOptions,
    *,
    overwrite: bool,
    asynchronous: bool,
    extra: dict[str, Any] | None,
    flat: FlatTree | None,
    adapter: SaveAdapter,
    base: Location | Storage | None,
    identical: frozenset[int],
    t0: float,
) -> _Prepared:
    coord = rv.coord
    # Staging named after the job and the save's number: saves of two jobs to one location
    # never share it, and a failed save's clean-up never meets the files of the next one.
    storage.set_attempt(f"{coord.job_token()}-{rv.prefix.rpartition('/')[2]}")
    if options.compression is not None and not compression.available():
        raise SnapshardError("compression needs zstd: install snapshard[compress]")
    if options.trees_differ != adapter.trees_differ:
        raise ValueError(
            "SaveOptions(trees_differ=True) saves torch state dicts that differ by rank "
            "(snapshard.torch); a JAX tree is global: an array on a sub-mesh is saved by the "
            "processes of its devices as it is"
        )
    if options.trees_differ and (base is not None or options.hashes):
        raise ValueError(
            "a save of differing trees (SaveOptions.trees_differ) cannot be incremental yet"
        )
    increment = None
    if base is not None or options.hashes:
        increment = Increment(base, storage, identical)
    flat = flat or flatten(tree, adapter.is_leaf)
    leaves = classify_leaves(flat, coord.process_count, adapter)
    arrays = [(i, leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, SaveArray)]
    layouts = [a.layout for _, a in arrays]
    if options.trees_differ:  # each holder set planned on its own, alike on each of its holders
        keys = [path_json(a.path) for _, a in arrays]
        plan = plan_by_holders(layouts, keys, options.mode, num_processes=coord.process_count)
    else:
        plan = plan_writes(layouts, options.mode, num_processes=coord.process_count)
    t1 = time.perf_counter()
    items, copied = adapter.stage(arrays, plan, coord.process_index, copy=asynchronous)
    # Host values are assumed equal on every process: their digests are compared at commit.
    digests = leaf_digests(leaves, values=coord.process_count > 1)
    storage.prepare_staging()  # from now on a load of the location can tell a save runs
    t2 = time.perf_counter()
    timings = SaveTimings(plan_s=t1 - t0, stage_s=t2 - t1, blocking_s=t2 - t0, bytes_staged=copied)
    return _Prepared(
        storage, rv, leaves, flat.structure, plan, items, overwrite, options, extra or {},
        digests, timings, increment, adapter=adapter,
    )  # fmt: skip


def _layout_digest(arr: SaveArray) -> int:
    """crc32c of where an array's boxes live: equal on every process for a global array."""
    lay = arr.layout
    if lay.memo.digest is None:
        # (a value held by the saving process alone is alike on every process that holds it)
        held = b"own" if lay.memo.own else lay.process_ids.tobytes()
        lay.memo.digest = crc32c(held, crc32c(lay.starts.tobytes() + lay.stops.tobytes()))
    return lay.memo.digest


def leaf_digests(leaves: list[Leaf | SaveArray], values: bool) -> np.ndarray:
    """Per leaf, crc32c of its description and (with `values`) of its value for host values,
    as this process sees them: processes that disagree are found at commit."""
    out = np.zeros(len(leaves), records.DIGEST)
    described: dict[tuple[Any, ...], tuple[str, str]] = {}  # arrays alike: all but the path
    for i, leaf in enumerate(leaves):
        path = path_json(leaf.path)
        if isinstance(leaf, PerProcessLeaf):  # differs by design
            out[i] = (crc32c(f'["per_process", {path}]'.encode()), 0)
            continue
        if not isinstance(leaf, SaveArray):
            assert isinstance(leaf, ValueLeaf)
            desc = f'["value", {path}]'
            value = (
                crc32c(json.dumps(encode_value(leaf.value, leaf.name)).encode()) if values else 0
            )
        else:
            key = (id(leaf.layout), leaf.kind, leaf.dtype, leaf.key_impl, leaf.devices is None)
            around = described.get(key)
            if around is None:
                # json.dumps([kind, path, dtype, shape, key_impl, host, layout digest])
                rest = json.dumps([leaf.dtype.name, list(leaf.shape), leaf.key_impl,
                                   leaf.devices is None, _layout_digest(leaf)])  # fmt: skip
                around = described[key] = (f"[{json.dumps(leaf.kind)}, ", f", {rest[1:]}")
            desc = around[0] + path + around[1]
            value = 0
            if values and isinstance(
                leaf.source, np.ndarray | np.generic
            ):  # NumPy: the same value is assumed on every process
                value = crc32c(np.ascontiguousarray(leaf.source).reshape(-1).view(np.uint8).data)
            elif values and isinstance(leaf.source, ReplicatedSource):
                value = leaf.source.value_digest()
        out[i] = (crc32c(desc.encode()), value)
    return out


_encode_str = json.encoder.encode_basestring_ascii  # what json.dumps writes a str as


def path_json(path: Path) -> str:
    """json.dumps(list(path)), without the encoder's cost per call (str and int keys)."""
    parts = []
    for k in path:
        if type(k) is str:
            parts.append(_encode_str(k))
        else:
            parts.append(int.__repr__(k) if type(k) is int else json.dumps(k))
    return f"[{', '.join(parts)}]"


def write_data_files(
    storage: Storage,
    pid: int,
    nonce: str,
    items: list[StagedItem],
    count: int,
    codec_of: Any = None,
) -> list[WrittenFile]:
    """Process `pid`'s items into `count` data files of nearly equal size, written in
    parallel (one thread per file), or on an object store into more files where that keeps
    each within one request (`Storage.data_file_bytes`), as many at once as `count` writers'
    upload memory holds (`files_at_once`); per file, its size and its (leaf, chunk record)
    rows."""
    files = write_chunk_files(storage, pid, nonce, items, count, codec_of)
    return [(f.size, f.records()) for f in files]


def write_chunk_files(
    storage: Storage,
    pid: int,
    nonce: str,
    items: list[StagedItem],
    count: int,
    codec_of: Any = None,
) -> list[FileChunks]:
    """write_data_files with each file's records as columns (chunk_files.FileChunks)."""
    groups = cut_files(items, count, storage.data_file_bytes)
    names = [data_file_name(pid, nonce, j) for j in range(len(groups))]
    at_once = files_at_once(groups, count, storage.upload_bytes_per_writer)
    return write_files(storage, names, groups, codec_of, at_once)


def _write_own(prep: _Prepared) -> dict[str, Any]:
    """Write this process's data files and its record file; returns the report that tells
    process 0 what was written (names follow from process and nonce), as JSON."""
    pid, nonce, inc = prep.rendezvous.coord.process_index, prep.nonce, prep.increment
    prep.storage.prepare_staging()
    files, data_bytes = _write_data(prep)
    chunks = _Chunks.of(files, inc.ref_rows if inc is not None else [])
    if len(chunks.leaf) != len(prep.items):  # each process checks its records against its plan
        raise CoordinationError(
            f"{prep.rendezvous.what}: process {pid} wrote {len(chunks.leaf)} chunks, its plan has {len(prep.items)}"
        )
    data = _record_file(prep, chunks)
    prep.storage.write_bytes(record_file_name(pid, nonce), data)
    tree, planned = "", 0
    if prep.options.trees_differ:
        # Processes of one tree write the same bytes under the same name: one file each.
        doc = _tree_file(prep)
        tree = f"{crc32c(doc):08x}{len(doc):x}"
        prep.storage.write_bytes(tree_file_name(tree), doc)
        planned = int(prep.plan.bytes_per_process()[pid]) if prep.plan.arrays else 0
    own = {i: leaf.value for i, leaf in enumerate(prep.leaves) if isinstance(leaf, PerProcessLeaf)}
    values = b""
    if own:
        values = per_process.encode_file(own, {i: prep.leaves[i].name for i in own})
        prep.storage.write_bytes(values_file_name(pid, nonce), values)
    sizes = tuple(f.size for f in files)
    written = np.concatenate([f.fixed for f in files]) if files else np.zeros(0, RECORD_FIXED)
    packed = _packed(written) if prep.options.compression is not None else (0, 0, ())
    prep.timings.bytes_written = data_bytes
    # Plain chunks' tables are their checksums, 4 bytes a block; compressed ones add offsets.
    tables = 4 * int(written["nblocks"].sum(dtype=np.int64)) + packed[0]
    prep.timings.bytes_metadata = tables + len(data)
    prep.timings.bytes_stored = sum(sizes) + len(data) + len(values)
    increment = inc.report() if inc is not None else {}
    return ProcessReport(
        nonce, sizes, len(data), crc32c(data), len(values), crc32c(values),
        crc32c(prep.digests.tobytes(), crc32c(json.dumps(prep.structure).encode())),
        refs_used=tuple(increment.get("refs_used", ())),
        referenced_bytes=int(increment.get("referenced_bytes", 0)),
        ref_codecs=tuple(increment.get("ref_codecs", ())),
        packed_saved=packed[1], codecs=packed[2], tree=tree, planned_bytes=planned,
    ).to_json()  # fmt: skip


def _tree_file(prep: _Prepared) -> bytes:
    """This process's own tree in a save of differing trees, for process 0's union (tree_union.py)."""
    leaves, meshes, layouts = _layouts(prep)
    plans = iter(prep.plan.arrays)
    digests = []
    for x in prep.leaves:
        if not isinstance(x, SaveArray):
            digests.append(0)
            continue
        plan = next(plans)
        # (the same bytes on every process of one tree: the plan of a value of the process's
        # own, which names that process, is left out, as its layout's process is)
        digests.append(0 if x.layout.memo.own else plan.digest)
    doc = {
        "tree": prep.structure, "leaves": [leaf_to_json(x, chunks=False) for x in leaves],
        "layouts": layouts, "meshes": meshes, "plans": digests,
    }  # fmt: skip
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass(frozen=True)
class _Chunks:
    """Every chunk record of this process's save as columns: the written chunks file by
    file, then the references of an incremental save."""

    leaf: np.ndarray
    fixed: np.ndarray  # records.RECORD_FIXED
    starts: list[Any]
    stops: list[Any]

    @staticmethod
    def of(files: list[FileChunks], refs: list[tuple[int, tuple[Any, ...]]]) -> _Chunks:
        fixed = [f.fixed for f in files]
        leaf = [f.leaves for f in files]
        starts = [it.start for f in files for it in f.items]
        stops = [it.stop for f in files for it in f.items]
        if refs:
            ref_fixed = np.zeros(len(refs), RECORD_FIXED)
            for i, (_, row) in enumerate(refs):
                ref_fixed[i] = tuple(row[:7])
            fixed.append(ref_fixed)
            leaf.append(np.asarray([x for x, _ in refs], np.int64))
            starts += [row[7] for _, row in refs]
            stops += [row[8] for _, row in refs]
        if not fixed:
            return _Chunks(np.zeros(0, np.int64), np.zeros(0, RECORD_FIXED), [], [])
        return _Chunks(np.concatenate(leaf), np.concatenate(fixed), starts, stops)


def _packed(fixed: np.ndarray) -> tuple[int, int, tuple[int, ...]]:
    """Of the compressed chunks written (`fixed`: their records' fixed fields): the bytes of
    their block offsets (tables beyond the checksums), the bytes compression saved (the
    commit's size check allows for it), and the codecs used."""
    codec = (fixed["flags"].astype(np.int64) & records.CODEC_MASK) >> records.CODEC_SHIFT
    on = fixed[codec != 0]
    offsets = 8 * int((on["nblocks"].astype(np.int64) + 1).sum())
    stored = on["crc_offset"].astype(np.int64) - on["offset"].astype(np.int64)
    saved = int((on["nbytes"].astype(np.int64) - stored).sum())
    return offsets, saved, tuple(sorted(set(codec[codec != 0].tolist())))


def _write_data(prep: _Prepared) -> tuple[list[FileChunks], int]:
    """This process's data files (as many as `writers` says, or the tuner picks); returns
    them and the array bytes they hold."""
    tuner = None
    count = prep.options.writers
    if count is None:
        url = prep.storage.url
        tuner = write_tuning.counts_for(url, is_object_store_url(url))
        count = tuner.choose(sum(it.nbytes for it in prep.items))
    t_data = time.perf_counter()
    inc = prep.increment
    items = prep.items if inc is None else inc.split(prep.items, prep.leaves, count)
    codec_of = None
    if prep.options.compression is not None:
        option = prep.options.compression
        codec_of = lambda it: encoding.codec_for(option, prep.leaves[it.leaf].dtype)  # noqa: E731
    pid = prep.rendezvous.coord.process_index
    data_bytes = sum(it.nbytes for it in items)
    files = write_chunk_files(prep.storage, pid, prep.nonce, items, count, codec_of)
    if tuner is not None:
        tuner.record(count, data_bytes, time.perf_counter() - t_data)
    prep.timings.data_files = len(files)
    return files, data_bytes


def rows_by_leaf(files: list[WrittenFile]) -> dict[int, list[ChunkRecord]]:
    """The records of written data files (write_data_files) grouped by leaf."""
    by_leaf: dict[int, list[ChunkRecord]] = {}
    for _, rows in files:
        for leaf, row in rows:
            by_leaf.setdefault(leaf, []).append(row)
    return by_leaf


def _record_file(prep: _Prepared, chunks: _Chunks) -> bytes:
    """This process's record file: its records per leaf, the digests, and (incremental
    saves) the chunks' content hashes."""
    pid, inc = prep.rendezvous.coord.process_index, prep.increment
    ndims = [len(leaf.shape) if isinstance(leaf, SaveArray) else 0 for leaf in prep.leaves]
    segments = records.sorted_segments(
        chunks.leaf, chunks.fixed, chunks.starts, chunks.stops, ndims
    )
    salt = name_key(record_file_name(pid, prep.nonce))
    if inc is not None:
        hashes = inc.segment_hashes(segments)
        return records.encode(pid, ndims, segments, prep.digests, hashes, inc.hid, salt=salt)
    return records.encode(pid, ndims, segments, prep.digests, salt=salt)


def _check_agreement(prep: _Prepared, reports: list[ProcessReport]) -> None:
    """Every process saved the same tree, with the same host values: where a digest
    differs, the differing process's record file says which leaf."""
    ours = reports[0].digest
    for q, r in enumerate(reports):
        if r.digest != ours:
            raw = prep.storage.read_staging(record_file_name(q, r.nonce))
            raise _disagreement(prep, q, records.staged_digests(raw))


def _disagreement(prep: _Prepared, q: int, theirs: np.ndarray | None) -> CoordinationError:
    """What differs between process 0's tree and process q's (`theirs`: the digests of q's
    record file, None where it cannot be read), naming the leaves where it can."""
    what, mine = prep.rendezvous.what, prep.digests
    if theirs is None:
        return CoordinationError(f"{what}: process {q}'s record file cannot be read back")
    if len(theirs) == len(mine):
        differ = np.flatnonzero(mine["description"] != theirs["description"])
        if len(differ) == 1:  # one leaf in place: its kind, dtype, shape or layout changed
            return CoordinationError(
                f"{what}: leaf {_name(prep.leaves[int(differ[0])])!r} differs between process 0 "
                f"and process {q} (kind, dtype, shape or layout)"
            )
        if len(differ) == 0:
            values = np.flatnonzero(mine["value"] != theirs["value"])
            if len(values):
                return CoordinationError(
                    f"{what}: leaf {_name(prep.leaves[int(values[0])])!r} has another value on "
                    f"process {q} than on process 0; leaves that are not sharded arrays "
                    "(jax.Array, DTensor) must be the same on every process: wrap values that "
                    "differ by design in snapshard.PerProcess"
                )
            return CoordinationError(
                f"{what}: the tree structure differs between process 0 and process {q}"
            )
    return _other_leaves(prep, q, theirs)


def _other_leaves(prep: _Prepared, q: int, theirs: np.ndarray) -> CoordinationError:
    """Process q's leaves are not process 0's. A leaf's description digest covers its path,
    kind, dtype, shape and layout: process 0's leaves whose digest q lacks are named, and
    q's leaves that process 0 lacks are placed after the last leaf both have."""
    mine = prep.digests["description"].tolist()
    ours = {d: i for i, d in enumerate(mine)}
    their_set = set(theirs["description"].tolist())
    lacking = [_name(prep.leaves[i]) for i, d in enumerate(mine) if d not in their_set]
    extra: list[str] = []
    extra_at: list[int] = []  # positions in q's leaves: q names them (_named_by_us)
    last_common = None
    for j, d in enumerate(theirs["description"].tolist()):
        if d in ours:
            last_common = _name(prep.leaves[ours[d]])
        else:
            extra.append("first" if last_common is None else f"after {last_common!r}")
            extra_at.append(j)
    count = lambda n: f"{n} leaf" if n == 1 else f"{n} leaves"  # noqa: E731
    parts = [f"process {q} saved {count(len(theirs))}, process 0 saved {count(len(mine))}"]
    trees_differ = (
        "; for state whose keys differ by rank by design (pipeline stages, expert groups), "
        "save it with SaveOptions(trees_differ=True)"
    )
    if extra:
        parts.append(
            f"process {q} has {len(extra)} that process 0 has not ({', '.join(extra[:3])}"
            + (", ..." if len(extra) > 3 else "")
            + " in its tree)"
        )
    if lacking:
        parts.append(
            ", ".join(repr(n) for n in lacking[:3])
            + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
            + f" of process 0 not on process {q} (or with another kind, dtype, shape or layout)"
        )
    error = CoordinationError(
        f"{prep.rendezvous.what}: the trees differ: " + "; ".join(parts) + trees_differ
    )
    error.relay = {"tree_extra": {"process": q, "leaves": extra_at[:3]}}  # type: ignore[attr-defined]
    return error


def _named_by_us(prep: _Prepared, error: CoordinationError) -> CoordinationError | None:
    """Process 0's tree check found leaves of this process that it has not, and could only
    place them: this process names them."""
    relay = getattr(error, "relay", None)
    extra = relay.get("tree_extra") if isinstance(relay, dict) else None
    if not extra or extra.get("process") != prep.rendezvous.coord.process_index:
        return None
    names = [_name(prep.leaves[i]) for i in extra["leaves"] if 0 <= i < len(prep.leaves)]
    if not names:
        return None
    shown = ", ".join(repr(n) for n in names)
    return type(error)(f"{error}; this process's leaves that process 0 has not: {shown}")


def _name(leaf: Leaf | SaveArray) -> str:
    return leaf.name


def _layouts(prep: _Prepared) -> tuple[list[Leaf], list[dict[str, Any]], list[dict[str, Any]]]:
    """The manifest's leaves, with one compact description per distinct layout and mesh."""
    meshes: dict[tuple[Any, ...], int] = {}
    mesh_docs: list[dict[str, Any]] = []
    layouts: dict[str, int] = {}
    layout_docs: list[dict[str, Any]] = []
    # Arrays laid out alike share their layout object: describe each once.
    per_layout: dict[int, tuple[int, bool]] = {}  # id(layout): (layout id, many candidates)
    plans = iter(prep.plan.arrays)
    out: list[Leaf] = []
    counts: dict[int, int] = {}  # id(plan.nbytes): chunks (arrays alike share the column)
    no_chunks = ChunkTable.empty(0)  # v2 leaves list no chunks: one table for them all
    for leaf in prep.leaves:
        if isinstance(leaf, PerProcessLeaf):
            out.append(PerProcessLeaf(leaf.path, None))  # the values stay in their files
            continue
        if not isinstance(leaf, SaveArray):
            out.append(leaf)
            continue
        plan = next(plans)
        known = per_layout.get(id(leaf.layout))
        if known is None:
            desc = _describe(leaf, prep.adapter, meshes, mesh_docs)
            lid = layouts.setdefault(json.dumps(desc, sort_keys=True), len(layouts))
            if lid == len(layout_docs):
                layout_docs.append(desc)
            groups = leaf.layout.shards
            known = (lid, bool(groups.count) and int(groups.num_candidates.max()) > 8)
            per_layout[id(leaf.layout)] = known
        lid, many_candidates = known
        writers = None
        if many_candidates:
            w = np.unique(plan.writer)
            if len(w) <= 64:
                writers = tuple(int(x) for x in w)
        count = counts.get(id(plan.nbytes))
        if count is None:
            count = counts[id(plan.nbytes)] = int(np.count_nonzero(plan.nbytes))
        out.append(
            ArrayLeaf(
                leaf.path, leaf.kind, checked_dtype(leaf.dtype, leaf.name), leaf.shape,
                leaf.sharding, leaf.key_impl, chunks=no_chunks, layout=lid, writers=writers,
                chunk_count=count,
            )
        )  # fmt: skip
    return out, mesh_docs, layout_docs


def _describe(
    arr: SaveArray,
    adapter: SaveAdapter,
    meshes: dict[tuple[Any, ...], int],
    mesh_docs: list[dict[str, Any]],
) -> dict[str, Any]:
    """The compact description of an array's layout (format.layouts), checked against the
    layout itself: a description that would mislead a reader falls back to explicit rows."""
    memo = arr.layout.memo
    if memo.own:  # the saving process's own: the union names it (tree_union.py)
        return {"kind": "own"}
    if memo.description is None:
        memo.description = _description(arr, adapter.mesh_of(arr))
    desc, mesh = memo.description
    if mesh is not None:
        mid = meshes.setdefault(mesh.key(), len(meshes))
        if mid == len(mesh_docs):
            mesh_docs.append(mesh.to_json())
        desc = {**desc, "mesh": mid}
    return desc


def _description(arr: SaveArray, found: MeshSpec | None) -> tuple[dict[str, Any], Mesh | None]:
    """`found`: the array's mesh and spec, from its framework's adapter."""
    if arr.devices is None and isinstance(arr.source, np.ndarray | np.generic):
        return {"kind": "host"}, None
    if found is not None:
        axes, shape, processes, spec = found
        mesh = Mesh(axes, shape, processes)
        try:
            derived = mesh_layout(mesh, spec, arr.shape, arr.layout.itemsize, arr.name)
        except CorruptCheckpointError:
            derived = None
        if derived is not None and same_holders(derived.shards, arr.layout.shards):
            return {"kind": "mesh", "spec": spec}, mesh
    return describe_rows(arr.layout), None


def _commit(prep: _Prepared, docs: list[dict[str, Any]]) -> None:
    """Process 0: check the reports (`docs`, each a ProcessReport's JSON) against the plan
    and the staged files, write the manifest, commit. O(processes): no process's records
    are read."""
    url = prep.storage.url
    reports = [ProcessReport.from_json(d) for d in docs]
    _check_same_options(prep, reports)
    union = _union(prep, reports) if prep.options.trees_differ else None
    if union is None:
        _check_agreement(prep, reports)
    table = ProcessTable(
        nonces=[r.nonce for r in reports],
        data_sizes=[list(r.sizes) for r in reports],
        record_sizes=[r.record_size for r in reports],
        record_crcs=[r.record_crc for r in reports],
    )
    if any(isinstance(leaf, PerProcessLeaf) for leaf in prep.leaves):
        table.values_sizes = [r.values_size for r in reports]
        table.values_crcs = [r.values_crc for r in reports]
    if union is None:
        structure, (leaves, meshes, layouts) = prep.structure, _layouts(prep)
    else:
        structure, leaves, meshes, layouts = (
            union.structure,
            union.leaves,
            union.meshes,
            union.layouts,
        )
        table.leaf_map = union.leaf_map
        if any(isinstance(leaf, PerProcessLeaf) for leaf in leaves):
            table.values_sizes = [r.values_size for r in reports]
            table.values_crcs = [r.values_crc for r in reports]
    manifest = Manifest(
        structure=structure,
        leaves=leaves,
        files=table.files(),
        process_count=len(reports),
        write_mode=prep.plan.mode,
        extra=prep.extra,
        meshes=meshes,
        layouts=layouts,
        processes=table,
    )
    expected = staged_files(table)
    # Bytes stored = each array's bytes plus its checksums: the tiling, from the sizes alone.
    # (the plans of differing trees are each process's own: each reports its planned bytes)
    if union is not None:
        planned = sum(r.planned_bytes for r in reports)
    else:
        planned = int(prep.plan.bytes_per_process().sum()) if prep.plan.arrays else 0
    planned -= sum(r.referenced_bytes + r.packed_saved for r in reports)
    stored = sum(f.size for f in manifest.files)
    if stored < planned:
        raise CoordinationError(
            f"save to {url}: the data files hold {stored} bytes, the plan {planned}"
        )
    if prep.increment is not None and prep.increment.base is not None:
        manifest.refs = manifest_refs(prep.increment.base, docs)
        manifest.files = manifest.files + check_refs_committed(prep.storage, manifest.refs)
    used = {c for r in reports for c in (*r.codecs, *r.ref_codecs)}
    manifest.codecs = [records.CODECS[c] for c in sorted(used)]
    commit_manifest(prep.storage, manifest, expected, overwrite=prep.overwrite)


def _check_same_options(prep: _Prepared, reports: list[ProcessReport]) -> None:
    """Every process saved with the same SaveOptions.trees_differ as process 0."""
    for q, r in enumerate(reports):
        if bool(r.tree) != prep.options.trees_differ:
            raise CoordinationError(
                f"{prep.rendezvous.what}: process {q} saved with SaveOptions(trees_differ="
                f"{bool(r.tree)}), process 0 with trees_differ={prep.options.trees_differ}: every "
                "process passes the same options"
            )


def _union(prep: _Prepared, reports: list[ProcessReport]) -> tree_union.Union:
    """Process 0 of a save of differing trees: the union of the processes' trees, from one tree file
    and record file per distinct report digest; every tree file is removed after."""
    storage, what = prep.storage, prep.rendezvous.what
    groups: dict[int, list[int]] = {}
    for q, r in enumerate(reports):
        groups.setdefault(r.digest, []).append(q)

    def read(processes: list[int]) -> tree_union.SavedTree:
        q = processes[0]
        nonce, name = reports[q].nonce, tree_file_name(reports[q].tree)
        try:
            doc = json.loads(storage.read_staging(name))
            digests = records.staged_digests(storage.read_staging(record_file_name(q, nonce)))
        except (SnapshardError, OSError, ValueError) as e:
            raise CoordinationError(f"{what}: process {q}'s tree cannot be read back: {e}") from e
        where = f"{storage.url}/{name}"
        shardings: dict[str, Any] = {}
        leaves = [leaf_from_json(d, where, 2, shardings) for d in doc["leaves"]]
        if digests is None or len(digests) != len(leaves):
            raise CoordinationError(f"{what}: process {q}'s record file does not match its tree")
        return tree_union.SavedTree(
            processes, doc["tree"], leaves, doc["layouts"], doc["meshes"], doc["plans"], digests
        )

    with ThreadPoolExecutor(min(16, len(groups)), "snapshard-trees") as pool:
        trees = list(pool.map(read, groups.values()))
    storage.delete_staging_files(sorted({tree_file_name(r.tree) for r in reports}))
    return tree_union.union(trees, len(reports), what)


def staged_files(table: ProcessTable) -> dict[str, int]:
    """Every file the processes of a save staged (data, records, values), with its size."""
    expected = {f.name: f.size for f in table.files()}
    expected.update({table.record_name(q): size for q, size in enumerate(table.record_sizes)})
    expected.update(
        {
            values_file_name(q, n): size
            for q, (n, size) in enumerate(zip(table.nonces, table.values_sizes, strict=False))
        }
    )
    return expected


def commit_manifest(
    storage: Storage, manifest: Manifest, expected: dict[str, int], *, overwrite: bool
) -> None:
    """The last step of every save: the manifest validated, the staged files exactly
    `expected` (name: size), then the storage's commit (rename, or marker written last)."""
    validate_structure(manifest, storage.url)
    check_staged_files(storage, expected)
    storage.commit(manifest.to_json(), overwrite=overwrite)


def check_staged_files(storage: Storage, expected: dict[str, int]) -> None:
    """Files on storage are exactly those of this save, with the sizes reported.

    Files of an earlier attempt that died (other nonces) are removed first, and the
    writers' owner records (storage/stale_staging.py), which are no part of a checkpoint.
    """
    listing = storage.list_staging()
    records = [n for n in listing if is_owner_record(n)]
    stale = [n for n in listing if n not in expected and not is_owner_record(n)]
    if stale:
        log.warning(
            "save to %s: removing %d stale file(s) of an earlier attempt", storage.url, len(stale)
        )
        storage.delete_staging_files(stale)
    if records:
        storage.delete_staging_files(records)
    for name, size in expected.items():
        if listing.get(name) != size:
            raise CoordinationError(
                f"save to {storage.url}: file {name!r} has {listing.get(name)} bytes on storage, its process reported {size}"
            )


def _discard_own(prep: _Prepared, settled: bool) -> None:
    """The files this process staged for a save that failed, removed (process 0 removes
    the staging area; this process's files may come after that), and once process 0 has
    failed the save (`settled`), the staging area if that leaves it empty. Never another
    process's files, which may still be in the making. Best effort: the save's own error
    is what the caller must see."""
    mine = f"p{prep.rendezvous.coord.process_index:05d}-{prep.nonce}"
    try:
        names = [n for n in prep.storage.list_staging() if n.rpartition("/")[2].startswith(mine)]
        prep.storage.delete_staging_files(names)
        if settled:  # process 0 writes no more: the last process to leave removes it
            prep.storage.discard_staging_if_empty()
    except SnapshardError as e:
        log.warning("%s: could not remove this process's files: %s", prep.rendezvous.what, e)


def finish(prep: _Prepared) -> SaveTimings:
    """The background phase. Raises on this process if the save failed anywhere; the
    adapter's `release` runs once it has ended, however it ended."""
    try:
        return _finish(prep)
    finally:
        prep.adapter.release()


def _finish(prep: _Prepared) -> SaveTimings:
    t0 = time.perf_counter()
    t1 = t0

    def write() -> dict[str, Any]:
        nonlocal t1
        report = _write_own(prep)
        t1 = time.perf_counter()
        prep.timings.write_s = t1 - t0
        return report

    try:
        write_then_commit(
            prep.rendezvous, write, lambda reports: _commit(prep, reports),
            prep.storage.discard_staging, lambda settled: _discard_own(prep, settled),
        )  # fmt: skip
    except CoordinationError as e:
        named = _named_by_us(prep, e)
        if named is None:
            raise
        raise named from e
    t2 = time.perf_counter()
    prep.timings.commit_s = t2 - t1
    prep.timings.total_s = prep.timings.blocking_s + (t2 - t0)
    return prep.timings


def refuse_existing(storage: Storage, overwrite: bool) -> None:
    """A synchronous save's early refusal of an existing checkpoint, before any work (the
    commit checks again, atomically)."""
    if not overwrite and storage.is_committed():
        raise CheckpointExistsError(
            f"a checkpoint already exists at {storage.url} (pass overwrite=True to replace it)"
        )


def save(
    directory: Location | Storage,
    tree: Any,
    options: SaveOptions = SaveOptions(),
    *,
    overwrite: bool = False,
    coordinator: Coordinator | None = None,
    base: Location | Storage | None = None,
) -> SaveTimings:
    """Save `tree` to `directory`, atomically: the checkpoint appears whole or not at all.

    Every process of a multi-process job calls this with the same tree; each writes only the
    slices the shared plan gives it (`options`: the write mode, writers, compression; see
    snapshard.SaveOptions). An existing checkpoint there is an error unless `overwrite`
    (then it is replaced whole, and stays whole until the new one commits); an existing
    empty directory holds nothing to lose and is written into; a directory of other files
    is never replaced.

    With `base` (a committed checkpoint beside this one), chunks whose bytes equal the
    base's chunk of the same box are recorded as references to the file holding them
    instead of being written (see snapshard.incremental); such a save records the chunks'
    content hashes, so that a later save may use it as base in turn.
    """
    return save_through(
        None, directory, tree, options, overwrite=overwrite, coordinator=coordinator, base=base
    )


@collection_paused()
def save_through(
    adapter: SaveAdapter | None,
    directory: Location | Storage,
    tree: Any,
    options: SaveOptions,
    *,
    overwrite: bool,
    coordinator: Coordinator | None,
    base: Location | Storage | None,
) -> SaveTimings:
    """A synchronous save through a framework's adapter (every wing's `save`; None: JAX's)."""
    storage = storage_for(directory)
    refuse_existing(storage, overwrite)
    prep = prepare(
        storage, tree, options, overwrite=overwrite, coordinator=coordinator, base=base,
        adapter=adapter,
    )  # fmt: skip
    return finish(prep)


class AsyncSave(BackgroundTask[SaveTimings]):
    """A save whose background phase is running, for every framework: `wait()` returns its
    timings or raises. Whatever the framework's adapter holds for the save (torch's reused
    host buffers) goes back when it ends, whether it succeeded or not (`finish`)."""

    def __init__(self, prep: _Prepared):
        self._prep = prep
        # What the blocking phase made (items, views, JAX's shard objects) is kept out of
        # the collections the background phase sets off: gc_pause.py.
        frozen = Frozen()

        def run() -> SaveTimings:
            try:
                return finish(prep)
            finally:
                frozen.release()

        super().__init__(run, f"save to {prep.storage.url}")

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
    options: SaveOptions = SaveOptions(),
    *,
    overwrite: bool = False,
    coordinator: Coordinator | None = None,
    base: Location | Storage | None = None,
    extra: dict[str, Any] | None = None,
) -> AsyncSave:
    """Start a save and return once every owned slice is on the host.

    The caller may then change or donate its arrays (see staging.py for the rule when
    `options.host_budget` is smaller than the bytes this process owns). Writing, syncing,
    merging, validating and committing run in the background. An existing checkpoint at the
    location is detected at commit, without blocking here. `extra`: JSON values stored in
    the manifest beside the tree (the manager keeps its step and metrics there).
    """
    prep = prepare(
        directory, tree, options, overwrite=overwrite, coordinator=coordinator,
        asynchronous=True, extra=extra, base=base,
    )  # fmt: skip
    return AsyncSave(prep)
