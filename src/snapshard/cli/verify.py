"""`snapshard verify PATH`: read every chunk and check every checksum; stop at the first problem.

Before reading, the manifest's coverage is validated (every array tiled exactly once) and
every data file must have the size the manifest lists. Orbax checkpoints have no checksums:
every chunk is read and decoded, which finds missing and undecodable chunks only.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from typing import Any

from ..dtypes import dtype_from_name
from ..errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    SnapshardError,
)
from ..format import MANIFEST_NAME, ArrayLeaf, Manifest, validate_coverage
from ..format.record_reads import check_record_files
from ..planning.layout import Box
from ..storage import LocalStorage, Storage
from .ls import open_for_command
from .options import add_memory_option
from .output import Output, human_bytes
from .reader import CheckpointReader, chunk_slabs
from .tables import load_all_tables


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("verify", parents=[common], help="read every chunk and check every checksum")
    p.add_argument("path", help="a snapshard or Orbax checkpoint, or safetensors")
    add_memory_option(p)
    p.set_defaults(run=run)


def _file_size(storage: Storage, name: str, expected: int) -> int | None:
    """The size of a file, or None when it cannot be read at all. On a local filesystem
    the exact size, the file opened as every read opens it (a symbolic link or another kind
    of file is refused with the reason); elsewhere `expected` if its last byte can be read."""
    if isinstance(storage, LocalStorage):
        return storage.file_size(name)
    if expected == 0:
        return 0
    try:
        storage.read_into(name, expected - 1, [memoryview(bytearray(1))])
    except (SnapshardError, OSError):
        return None
    return expected


def file_problem(storage: Storage, m: Manifest) -> dict[str, Any] | None:
    """The first data file whose size differs from the manifest's, with the first chunk hit."""
    for i, f in enumerate(m.files):
        if not f.name:  # an unused slot of the references (format.refs)
            continue
        refused: str | None = None
        try:
            size = _file_size(storage, f.name, f.size)
        except CorruptCheckpointError as e:  # refused (a symbolic link, say) or missing
            size, refused = None, str(e)
        if size == f.size:
            continue
        hit = [
            (int(leaf.chunks.offset[c]), leaf.name, c)
            for leaf in m.arrays
            for c in range(len(leaf.chunks))
            if int(leaf.chunks.file[c]) == i
            and int(leaf.chunks.offset[c] + leaf.chunks.nbytes[c]) > (size or 0)
        ]
        what = "is missing or unreadable" if size is None else f"has {size} bytes"
        message = (
            refused or f"{storage.url}: data file {f.name!r} {what}, the manifest says {f.size}"
        )
        problem: dict[str, Any] = {"file": f.name, "leaf": None, "chunk": None}
        if hit:
            _, leaf_name, chunk = min(hit)
            message += f"; leaf {leaf_name!r}, chunk {chunk} is not all there"
            problem.update(leaf=leaf_name, chunk=chunk)
        return {"message": message, **problem}
    return None


def record_file_problem(storage: Storage, m: Manifest) -> dict[str, Any] | None:
    """v2: the first record file whose size differs from the manifest's (bytes appended to
    one are not read by anything, but the checkpoint is not the one committed)."""
    if m.processes is None:
        return None
    for q, expected in enumerate(m.processes.record_sizes):
        name = m.processes.record_name(q)
        try:
            size = _file_size(storage, name, expected)
        except CorruptCheckpointError as e:
            return {"message": str(e), "file": name, "leaf": None, "chunk": None}
        if size != expected:
            what = "is missing or unreadable" if size is None else f"has {size} bytes"
            message = f"{storage.url}: record file {name!r} {what}, the manifest says {expected}"
            return {"message": message, "file": name, "leaf": None, "chunk": None}
    return None


def verify(reader: CheckpointReader, out: Output, buffer_bytes: int) -> dict[str, Any]:
    m = reader.manifest
    arrays = m.arrays
    doc: dict[str, Any] = {
        "path": reader.url,
        "format": reader.format,
        "ok": False,
        "checksums": "crc32c" if reader.format == "snapshard" else None,
        "leaves": len(m.leaves),
        "chunks": sum(a.num_chunks for a in arrays),  # known without fetching the records
        "bytes": sum(a.nbytes for a in arrays),
        "bytes_checked": 0,
        "problem": None,
    }
    if reader.format == "snapshard":
        try:
            if m.version >= 2:
                assert reader.storage is not None
                check_record_files(reader.storage, m)
                load_all_tables(reader)
            validate_coverage(m, reader.url)
        except CorruptCheckpointError as e:  # (a record file missing or cut: named)
            assert reader.storage is not None
            doc["problem"] = record_file_problem(reader.storage, m) or {
                "message": str(e), "file": None, "leaf": None, "chunk": None,
            }  # fmt: skip
            return doc
        assert reader.storage is not None
        doc["problem"] = file_problem(reader.storage, m) or record_file_problem(reader.storage, m)
        if doc["problem"] is not None:
            return doc
    with out.progress(doc["bytes"], "verify") as bar:
        for batch in slab_batches(arrays, buffer_bytes):
            problem, n = check_batch(reader, batch, buffer_bytes)
            doc["bytes_checked"] += n
            bar.update(n)
            if problem is not None:
                doc["problem"] = problem
                return doc
    doc["ok"] = True
    return doc


# A batch of slabs is read as one restore batch: many small arrays cost one plan, not one
# each. Bounded in bytes (--buffer-mb) and in count (the plan's own per-slab cost).
BATCH_SLABS = 8192
WHOLE = -1  # the chunk number of a slab that is a whole array (every chunk of it)

Slab = tuple[ArrayLeaf, int, Box]


def array_slabs(leaf: ArrayLeaf, buffer_bytes: int) -> Iterator[Slab]:
    """An array that fits in `buffer_bytes` as one slab (reading it reads every chunk),
    else each of its chunks as slabs of at most `buffer_bytes`."""
    if leaf.nbytes <= buffer_bytes:
        yield leaf, WHOLE, ((0,) * len(leaf.shape), leaf.shape)
        return
    for c, box in chunk_slabs(leaf, buffer_bytes):
        yield leaf, c, box


def slab_batches(arrays: list[ArrayLeaf], buffer_bytes: int) -> Iterator[list[Slab]]:
    """Every array's slabs gathered into batches of at most `buffer_bytes` and
    BATCH_SLABS slabs (a slab larger than the budget goes alone)."""
    batch: list[Slab] = []
    held = 0
    for leaf in arrays:
        itemsize = dtype_from_name(leaf.dtype).itemsize
        for slab in array_slabs(leaf, buffer_bytes):
            start, stop = slab[2]
            n = math.prod(b - a for a, b in zip(start, stop, strict=True)) * itemsize
            if batch and (held + n > buffer_bytes or len(batch) >= BATCH_SLABS):
                yield batch
                batch, held = [], 0
            batch.append(slab)
            held += n
    if batch:
        yield batch


def check_batch(
    reader: CheckpointReader, batch: list[Slab], buffer_bytes: int
) -> tuple[dict[str, Any] | None, int]:
    """(the first problem, bytes checked) of reading a batch of slabs. A batch that fails
    is read again chunk by chunk, so that the problem names the first damaged chunk."""
    try:
        boxes = reader.read_boxes([(leaf, a, b) for leaf, _, (a, b) in batch])
    except (SnapshardError, OSError, ValueError):
        pass
    else:
        return None, sum(int(x.nbytes) for x in boxes)
    checked = 0
    for leaf, c, box in batch:
        pieces = chunk_slabs(leaf, buffer_bytes) if c == WHOLE else [(c, box)]
        for chunk, (start, stop) in pieces:
            try:
                got = reader.read_box(leaf, start, stop)
            except ChecksumMismatchError as e:
                return _mismatch(e), checked
            except (SnapshardError, OSError, ValueError) as e:
                return _read_problem(reader, leaf, chunk, e), checked
            checked += int(got.nbytes)
    return None, checked  # the batch failed once, but every chunk of it reads: no damage


def _mismatch(e: ChecksumMismatchError) -> dict[str, Any]:
    return {"message": str(e), "file": e.file, "leaf": e.leaf, "chunk": e.chunk, "block": e.block}


def _read_problem(
    reader: CheckpointReader, leaf: ArrayLeaf, c: int, e: Exception
) -> dict[str, Any]:
    """The problem of chunk `c` of `leaf` that failed to read with `e` (a message that
    names the chunk already is kept as it is; the file as a checksum mismatch names it)."""
    m, where = reader.manifest, f"leaf {leaf.name!r}, chunk {c}"
    file = f"{reader.url}/{m.files[int(leaf.chunks.file[c])].name}" if m.files else None
    return {
        "message": str(e) if where in str(e) else f"{where}: {e}",
        "file": file,
        "leaf": leaf.name,
        "chunk": c,
    }


def _verify_or_damaged(reader: CheckpointReader, out: Output, buffer_bytes: int) -> dict[str, Any]:
    """verify(), with damage found while reading the metadata (the chunk records of a v2
    checkpoint, say) reported as damage rather than as a failure of the tool."""
    try:
        return verify(reader, out, buffer_bytes)
    except CorruptCheckpointError as e:
        problem = {"message": str(e), "file": None, "leaf": None, "chunk": None}
        return {"path": reader.url, "ok": False, "problem": problem}


def render(doc: dict[str, Any]) -> str:
    if not doc["ok"]:
        message = doc["problem"]["message"]
        if message.startswith(f"{doc['path']}: "):  # (most name the checkpoint themselves)
            return f"DAMAGED {message}"
        return f"DAMAGED {doc['path']}: {message}"
    what = "every checksum matches" if doc["checksums"] else "every chunk decodes (no checksums)"
    return (
        f"OK {doc['path']}: {doc['leaves']} leaves, {doc['chunks']} chunks, "
        f"{human_bytes(doc['bytes_checked'])} read, {what}"
    )


def run(args: argparse.Namespace, out: Output) -> int:
    try:
        reader = open_for_command(args.path, "verify")
    except CorruptCheckpointError as e:  # a damaged manifest is a finding, not bad input
        problem = {"message": str(e), "file": MANIFEST_NAME, "leaf": None, "chunk": None}
        doc = {"path": args.path, "ok": False, "problem": problem}
    else:
        with reader:
            doc = _verify_or_damaged(reader, out, args.buffer_bytes)
    out.result(doc, lambda: render(doc))
    return 0 if doc["ok"] else 1
