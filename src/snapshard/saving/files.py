"""What each process writes in the background phase, with no coordination: its data files
(in parallel), its record file, its values file and, where the trees differ, its tree
file; and the report that tells process 0 what was written."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import per_process
from ..checksum import crc32c
from ..errors import (
    CoordinationError,
)
from ..format import (
    data_file_name,
    encoding,
    json_pieces,
    record_file_name,
    records,
)
from ..format.binding import name_key
from ..format.files import ProcessReport
from ..format.leaves import PerProcessLeaf, leaf_to_json
from ..format.naming import tree_file_name, values_file_name
from ..format.records import RECORD_FIXED
from ..storage import Storage, is_object_store_url
from . import copies, write_tuning
from .chunk_files import FileChunks, cut_files, files_at_once, write_files
from .leaves import describe_leaves
from .save_array import SaveArray
from .staging import StagedItem
from .state import PreparedSave


def write_chunk_files(
    storage: Storage,
    pid: int,
    nonce: str,
    items: list[StagedItem],
    count: int,
    codec_of: Any = None,
) -> list[FileChunks]:
    """Process `pid`'s items into `count` data files of nearly equal size, written in
    parallel (one thread per file), or on an object store into more files where that keeps
    each within one request (`Storage.data_file_bytes`), as many at once as `count` writers'
    upload memory holds (`files_at_once`); each file with its records as columns."""
    groups = cut_files(items, count, storage.data_file_bytes)
    names = [data_file_name(pid, nonce, j) for j in range(len(groups))]
    at_once = files_at_once(groups, count, storage.upload_bytes_per_writer)
    return write_files(storage, names, groups, codec_of, at_once)


def write_own(prep: PreparedSave) -> dict[str, Any]:
    """Write this process's data files and its record file; returns the report that tells
    process 0 what was written (names follow from process and nonce), as JSON."""
    pid, nonce, inc = prep.rendezvous.coord.process_index, prep.nonce, prep.increment
    prep.storage.prepare_staging()
    files, data_bytes = _write_data(prep)
    chunks = ChunkColumns.of(files, inc.ref_rows if inc is not None else [])
    if len(chunks.leaf) != len(prep.items):  # each process checks its records against its plan
        raise CoordinationError(
            f"{prep.rendezvous.what}: process {pid} wrote {len(chunks.leaf)} chunks, its plan has {len(prep.items)}"
        )
    data = _record_file(prep, chunks)
    prep.storage.write_bytes(record_file_name(pid, nonce), data)
    tree, planned = "", 0
    if prep.options.trees_differ:
        # Processes of one tree write the same bytes under the same name: one file each.
        doc = tree_file(prep)
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
        crc32c(
            copies.tree_digest(prep.digests, prep.copies).tobytes(),
            crc32c(json_pieces.dumps(prep.structure).encode()),
        ),
        refs_used=tuple(increment.get("refs_used", ())),
        referenced_bytes=int(increment.get("referenced_bytes", 0)),
        ref_codecs=tuple(increment.get("ref_codecs", ())),
        packed_saved=packed[1], codecs=packed[2], tree=tree, planned_bytes=planned,
        location=crc32c(prep.storage.url.encode()),
        copies=copies.copies_digest(prep.digests, prep.copies),
    ).to_json()  # fmt: skip


def tree_file(prep: PreparedSave) -> bytes:
    """This process's own tree in a save of differing trees, for process 0's union (tree_union.py)."""
    leaves, meshes, layouts = describe_leaves(prep)
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
        "tree": prep.structure, "leaves": [leaf_to_json(x) for x in leaves],
        "layouts": layouts, "meshes": meshes, "plans": digests,
    }  # fmt: skip
    return json_pieces.dumps(doc).encode()


@dataclass(frozen=True)
class ChunkColumns:
    """Every chunk record of this process's save as columns: the written chunks file by
    file, then the references of an incremental save."""

    leaf: np.ndarray
    fixed: np.ndarray  # records.RECORD_FIXED
    starts: list[Any]
    stops: list[Any]

    @staticmethod
    def of(files: list[FileChunks], refs: list[tuple[int, tuple[Any, ...]]]) -> ChunkColumns:
        fixed = [f.fixed for f in files]
        leaf = [f.leaves for f in files]
        starts = [it.start for f in files for it in f.items]
        stops = [it.stop for f in files for it in f.items]
        if refs:
            fixed.append(np.array([tuple(row[:7]) for _, row in refs], RECORD_FIXED))
            leaf.append(np.asarray([x for x, _ in refs], np.int64))
            starts += [row[7] for _, row in refs]
            stops += [row[8] for _, row in refs]
        if not fixed:
            return ChunkColumns(np.zeros(0, np.int64), np.zeros(0, RECORD_FIXED), [], [])
        return ChunkColumns(np.concatenate(leaf), np.concatenate(fixed), starts, stops)

    def segments(self, ndims: list[int]) -> dict[int, np.ndarray]:
        """The records per leaf, as `records.encode` takes them."""
        return records.sorted_segments(self.leaf, self.fixed, self.starts, self.stops, ndims)


def _packed(fixed: np.ndarray) -> tuple[int, int, tuple[int, ...]]:
    """Of the compressed chunks written (`fixed`: their records' fixed fields): the bytes of
    their block offsets (tables beyond the checksums), the bytes compression saved (the
    commit's size check allows for it), and the codecs used."""
    codec = records.codecs_of(fixed["flags"])
    on = fixed[codec != 0]
    offsets = 8 * int((on["nblocks"].astype(np.int64) + 1).sum())
    stored = on["crc_offset"].astype(np.int64) - on["offset"].astype(np.int64)
    saved = int((on["nbytes"].astype(np.int64) - stored).sum())
    return offsets, saved, tuple(sorted(set(codec[codec != 0].tolist())))


def _write_data(prep: PreparedSave) -> tuple[list[FileChunks], int]:
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


def _record_file(prep: PreparedSave, chunks: ChunkColumns) -> bytes:
    """This process's record file: its records per leaf, the digests, and (incremental
    saves) the chunks' content hashes."""
    pid, inc = prep.rendezvous.coord.process_index, prep.increment
    ndims = [len(leaf.shape) if isinstance(leaf, SaveArray) else 0 for leaf in prep.leaves]
    segments = chunks.segments(ndims)
    salt = name_key(record_file_name(pid, prep.nonce))
    if inc is not None:
        hashes = inc.segment_hashes(segments)
        return records.encode(pid, ndims, segments, prep.digests, hashes, inc.hid, salt=salt)
    return records.encode(pid, ndims, segments, prep.digests, salt=salt)
