"""A save's data files: its staged items written back to back, their records as columns.

Each plain chunk of at most _RUN_CHUNK_BYTES (a state of many small arrays is mostly these)
is written in bulk: a run of them is checksummed block by block in one pass, bound to its
offsets (format.binding) and handed on as one list of parts of about _PIECE_BYTES, with
its records made as columns. Other chunks (larger, compressed) go through
format.encoding.write_chunk one by one, where the bytes, not the calls, set the time. Both
give the same bytes: a file's layout is the chunks of its items in their order, each
followed by its tables. Per chunk the bulk path holds the interpreter for a few calls only,
which is what a save's background phase takes from the training loop.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import crc32c as _crc32c
import numpy as np

from ..format.binding import name_key
from ..format.chunks import checksum_block
from ..format.encoding import chunk_span, write_chunk
from ..format.records import RECORD_FIXED
from ..storage import FileWriter, Storage
from ..storage.base import buffer_bytes, buffer_nbytes
from .staging import StagedItem

if TYPE_CHECKING:
    from typing_extensions import Buffer

# Writes shorter than this are gathered before they reach the storage (`CoalescingWriter`).
COALESCE_BYTES = 1 << 20
# A run of small chunks is written in pieces of about this many bytes (FileWriter.write_parts:
# joined into one buffer where the storage does not take the parts as they are).
_PIECE_BYTES = 4 << 20
# The most data files cut_files makes a process write to keep each within one request:
# every file is one more object to list at commit and one more row of the manifest.
MAX_CUT_FILES = 32
_MIX = np.uint64(0x9E3779B97F4A7C15)
# Plain chunks up to this size are written in runs (at most 64 checksum blocks each).
_RUN_CHUNK_BYTES = 256 << 10

CodecOf = Callable[[StagedItem], int]
# crc32c of any C-contiguous array's bytes (a memoryview cannot describe every dtype).
_crc = cast(Callable[[Any], int], _crc32c.crc32c)


class CoalescingWriter(FileWriter):
    """Writes shorter than COALESCE_BYTES gathered into one buffer and handed on together:
    a file of many small chunks would otherwise cost two writes (system calls, on local
    files) per chunk, its bytes and its checksums. Every write is handed on as kept (the
    caller leaves its buffers unchanged until the file is closed, as a save's staged items
    are), each gathered buffer too (a new one is started after it)."""

    def __init__(self, writer: FileWriter) -> None:
        self.writer = writer
        self.held = bytearray()

    def write(self, data: memoryview) -> None:
        if len(data) >= COALESCE_BYTES:
            self.flush()
            self.writer.write_kept(data)
            return
        self.held += data
        if len(self.held) >= COALESCE_BYTES:
            self.flush()

    write_kept = write

    def write_parts(self, parts: Sequence[Buffer]) -> None:
        if sum(buffer_nbytes(p) for p in parts) < COALESCE_BYTES:
            for p in parts:
                self.write(buffer_bytes(p))
            return
        self.flush()
        self.writer.write_parts(parts)

    def flush(self) -> None:
        if self.held:
            self.writer.write_kept(memoryview(self.held))  # never changed after this
            self.held = bytearray()

    def close(self) -> int:
        self.flush()
        return self.writer.close()

    def abort(self) -> None:
        self.held = bytearray()
        self.writer.abort()


@dataclass(frozen=True)
class FileChunks:
    """A data file just written: its size, and per chunk in file order its item (leaf and
    box) and its record's fixed fields (format.records.RECORD_FIXED)."""

    size: int
    items: list[StagedItem]
    fixed: np.ndarray  # RECORD_FIXED, one per item

    @property
    def leaves(self) -> np.ndarray:
        return np.fromiter((it.leaf for it in self.items), np.int64, len(self.items))


def cut_files(
    items: list[StagedItem], writers: int, most_bytes: int | None
) -> list[list[StagedItem]]:
    """Items into `writers` files of nearly equal size (split_files); with `most_bytes`
    (object stores, where a file of at most that size goes up in one request), into as
    many files as keep each within it, at most MAX_CUT_FILES: the bytes over that many
    files first, largest item first, each to the lightest file, or to a new file where it
    would take the lightest beyond `most_bytes`. An item larger than `most_bytes` makes a
    file of its own (it goes up in parts)."""
    if most_bytes is None or not items:
        return split_files(items, writers)
    spans = np.fromiter((chunk_span(it.nbytes) for it in items), np.int64, len(items))
    total = int(spans.sum())
    n = min(MAX_CUT_FILES, max(writers, -(-total // most_bytes)))
    if n <= writers:
        # (the bytes fit in `writers` files, but an even split may still put more in one)
        even = split_files(items, writers)
        if all(len(f) == 1 or sum(chunk_span(it.nbytes) for it in f) <= most_bytes for f in even):
            return even
    files: list[list[StagedItem]] = [[] for _ in range(n)]
    heap = [(0, j) for j in range(n)]
    for i in np.argsort(-spans, kind="stable").tolist():
        span = int(spans[i])
        load, j = heap[0]
        if load and load + span > most_bytes and len(files) < MAX_CUT_FILES:
            files.append([items[i]])
            heapq.heappush(heap, (span, len(files) - 1))
            continue
        files[j].append(items[i])
        heapq.heapreplace(heap, (load + span, j))
    return [f for f in files if f]


def files_at_once(groups: list[list[StagedItem]], writers: int, per_writer: int | None) -> int:
    """How many of these files to write at a time: `writers`, each with as many files in
    flight as `per_writer` bytes hold at the size of the largest (at least one; a file in
    parts holds no more than that). None: all of them (local files)."""
    if per_writer is None or not groups:
        return max(1, len(groups))
    largest = max(sum(chunk_span(it.nbytes) for it in g) for g in groups)
    return max(1, min(len(groups), writers * max(1, per_writer // max(1, largest))))


def split_files(items: list[StagedItem], n: int) -> list[list[StagedItem]]:
    """Items into n files of nearly equal size (largest first, each to the lightest file,
    the first of equally light ones)."""
    n = max(1, min(n, len(items)))
    sizes = np.fromiter((it.nbytes for it in items), np.int64, len(items))
    order = np.argsort(-sizes, kind="stable").tolist()
    files: list[list[StagedItem]] = [[] for _ in range(n)]
    if n == 1:
        return [[items[i] for i in order]] if items else []
    heap = [(0, j) for j in range(n)]
    nbytes = sizes.tolist()
    for i in order:
        load, j = heap[0]
        files[j].append(items[i])
        heapq.heapreplace(heap, (load + nbytes[i], j))
    return [f for f in files if f]


def _small(items: list[StagedItem], codec_of: CodecOf | None) -> np.ndarray:
    """Per item, whether it is a plain chunk written in a run (at most _RUN_CHUNK_BYTES)."""
    sizes = np.fromiter((it.nbytes for it in items), np.int64, len(items))
    small = (sizes > 0) & (sizes <= _RUN_CHUNK_BYTES)
    if codec_of is not None:
        small &= np.fromiter((codec_of(it) == 0 for it in items), bool, len(items))
    return small


def _tables(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The checksum block and the number of blocks of plain chunks of these sizes."""
    blocks = np.fromiter((checksum_block(n) for n in sizes.tolist()), np.int64, len(sizes))
    return blocks, -(-sizes // blocks)


def _runs(small: np.ndarray, stored: np.ndarray) -> list[tuple[int, int, bool]]:
    """The items as runs [i, j): of small chunks (at most about _PIECE_BYTES of output
    each, `stored`: each chunk's bytes with its table), or single other chunks."""
    out: list[tuple[int, int, bool]] = []
    edges = np.flatnonzero(np.diff(small.astype(np.int8))) + 1
    for i, j in itertools.pairwise([0, *edges.tolist(), len(small)]):
        if not small[i]:
            out.extend((k, k + 1, False) for k in range(i, j))
            continue
        piece = np.cumsum(stored[i:j]) // _PIECE_BYTES  # piece number of each chunk
        cuts = (np.flatnonzero(np.diff(piece)) + 1 + i).tolist()
        out.extend((a, b, True) for a, b in itertools.pairwise([i, *cuts, j]))
    return out


def _read_ahead(
    items: list[StagedItem], small: np.ndarray, stored: np.ndarray, i: int, j: int, ahead: int
) -> int:
    """Read the bytes of the small items from i on (those of the run [i, j) at least, and
    more while they come to at most `ahead` bytes, none the host budget left for later) in
    one bulk read, where their deferred bytes ask for it (WindowBytes.READ_AHEAD); the
    index after the last."""
    end = j
    total = int(stored[i:j].sum())
    while (
        end < len(items)
        and small[end]
        and not getattr(items[end].deferred, "later", False)
        and total + int(stored[end]) <= ahead
    ):
        total += int(stored[end])
        end += 1
    together = getattr(items[i].deferred, "read_together", None)
    if together is not None:
        together([it.deferred for it in items[i:end]])
    return end


def _contiguous(data: Any) -> np.ndarray:
    """The item's host bytes as one C-contiguous buffer."""
    if type(data) is np.ndarray and data.flags.c_contiguous:
        return data
    return np.ascontiguousarray(data)


def _write_run(
    writer: FileWriter,
    run: list[StagedItem],
    tables: tuple[np.ndarray, np.ndarray],
    file: int,
    offset: int,
    file_key: int,
) -> tuple[np.ndarray, int]:
    """Plain chunks of at most _RUN_CHUNK_BYTES back to back from `offset`: the bytes of
    each, then the crc32c of each of its checksum blocks XOR its chunk key (`tables`: their
    _tables); returns their fixed record fields and the offset after them."""
    # Deferred bytes that are read in bulk (a writer process's window) come in one request.
    together = getattr(run[0].deferred, "read_together", None)
    if together is not None:
        together([it.deferred for it in run])
    raws = [_contiguous(it.host if it.host is not None else it.materialize()) for it in run]
    sizes = np.fromiter((it.nbytes for it in run), np.int64, len(run))
    if any(r.nbytes != n for r, n in zip(raws, sizes.tolist(), strict=True)):
        raise ValueError(f"leaf {run[0].name!r}: staged bytes do not match the planned sizes")
    blocks, nblocks = tables
    ends = offset + np.cumsum(sizes + 4 * nblocks)
    starts = ends - sizes - 4 * nblocks
    keys = ((starts.astype(np.uint64) * _MIX) >> np.uint64(32)).astype(np.uint32)
    keys ^= np.uint32(file_key)
    if int(nblocks.max()) == 1:
        crcs = np.fromiter((_crc(r) for r in raws), np.uint32, len(raws))
    else:
        flat = [r.reshape(-1).view(np.uint8) for r in raws]
        crcs = np.fromiter(
            (_crc(u[a : a + b]) for u, b in zip(flat, blocks.tolist(), strict=True)
             for a in range(0, len(u), b)),
            np.uint32, int(nblocks.sum()),
        )  # fmt: skip
        keys = np.repeat(keys, nblocks)
    words = memoryview((crcs ^ keys).astype("<u4").tobytes())
    cuts = (4 * np.cumsum(nblocks)).tolist()
    parts: list[Any] = [None] * (2 * len(run))
    parts[0::2] = raws
    parts[1::2] = [words[a:b] for a, b in itertools.pairwise([0, *cuts])]
    writer.write_parts(parts)  # (no copy of the run joined: local files take them as they are)
    fixed = np.zeros(len(run), RECORD_FIXED)
    fixed["file"] = file
    fixed["offset"] = starts
    fixed["nbytes"] = sizes
    fixed["block"] = blocks
    fixed["nblocks"] = nblocks
    fixed["crc_offset"] = starts + sizes
    for it in run:
        it.release()  # the bytes are in the file now: let the host copy go
    return fixed, int(ends[-1])


def _write_one(
    writer: FileWriter, it: StagedItem, file: int, offset: int, file_key: int, codec: int
) -> tuple[np.ndarray, int]:
    row = write_chunk(
        writer, it.materialize(), it.start, it.stop, file, offset, file_key=file_key, codec=codec
    )
    it.release()
    fixed = np.zeros(1, RECORD_FIXED)
    fixed[0] = tuple(row)[:7]
    return fixed, row.end()


def write_file(
    storage: Storage,
    name: str,
    items: list[StagedItem],
    codec_of: CodecOf | None = None,
    file: int = 0,
) -> FileChunks:
    """Write items back to back into data file number `file` named `name`.
    `codec_of(item)` gives each item's codec (format.encoding; None: nothing compressed)."""
    # The staged items stay as they are until the save ends: the file may keep them.
    writer = CoalescingWriter(storage.open_writer(name))
    key = name_key(name)
    parts: list[np.ndarray] = []
    offset = 0
    try:
        small = _small(items, codec_of) if items else np.zeros(0, bool)
        stored = np.fromiter((it.nbytes for it in items), np.int64, len(items))
        # Each small chunk's checksum block and block count (zeros for the others).
        blocks, nblocks = np.zeros(len(items), np.int64), np.zeros(len(items), np.int64)
        if small.any():
            blocks[small], nblocks[small] = _tables(stored[small])
            stored += 4 * nblocks
        ahead = getattr(type(items[0].deferred), "READ_AHEAD", 0) if items else 0
        read_to = 0  # the small items before it were read ahead
        for i, j, run in _runs(small, stored) if items else ():
            if run and ahead and j > read_to:
                read_to = _read_ahead(items, small, stored, i, j, ahead)
            if run:
                tables = (blocks[i:j], nblocks[i:j])
                fixed, offset = _write_run(writer, items[i:j], tables, file, offset, key)
            else:
                it = items[i]
                codec = codec_of(it) if codec_of is not None else 0
                fixed, offset = _write_one(writer, it, file, offset, key, codec)
            parts.append(fixed)
        size = writer.close()
    except BaseException:
        writer.abort()
        raise
    fixed = np.concatenate(parts) if parts else np.zeros(0, RECORD_FIXED)
    return FileChunks(size, items, fixed)


def write_files(
    storage: Storage,
    names: list[str],
    groups: list[list[StagedItem]],
    codec_of: CodecOf | None = None,
    at_once: int | None = None,
) -> list[FileChunks]:
    """Each group of items into its data file, `at_once` files at a time (None: all), one
    thread each."""
    threads = min(len(groups), at_once or len(groups))
    if threads <= 1:
        return [
            write_file(storage, n, g, codec_of, j)
            for j, (n, g) in enumerate(zip(names, groups, strict=True))
        ]
    with ThreadPoolExecutor(threads, thread_name_prefix="snapshard-write") as pool:
        futures = [
            pool.submit(write_file, storage, names[j], groups[j], codec_of, j)
            for j in range(len(groups))
        ]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:  # the save has failed: files not started yet are not written
                f.cancel()
            raise
