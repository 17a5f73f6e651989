"""Format v2: the binary chunk records each process writes (`index/p<process>-<nonce>.idx`).

Layout of one record file (all integers little-endian; see docs/format.md):

    header     64 bytes: magic, version, process, leaf count, offsets of the tables
    directory  one 16-byte entry per leaf of the manifest, in leaf order:
               (byte offset of the leaf's segment, record count, crc32c of the segment)
    digests    one 8-byte entry per leaf: crc32c of the leaf's description and of its value
               as this process saw them (a committer compares them when processes disagree)
    segments   for each leaf this process wrote chunks of, its records back to back, sorted
               by box; a record is RECORD_FIXED bytes plus the box (2 · ndim int64)

A reader that needs leaf `a` of process `p` reads directory entry `a` (16 bytes at a known
offset), then that segment; the segment's crc32c (salted with process and leaf, so that an
entry pointing at another segment fails too) vouches for the records. Nothing is read that
the reader's boxes do not need, apart from the records of the same process and leaf.

Pure encoding and decoding: no I/O here.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c as _crc32c
import numpy as np

from ..checksum import crc32c
from ..errors import CorruptCheckpointError

RECORD_MAGIC = b"SNAPIDX2"
RECORD_VERSION = 2
# magic, version, process, leaves, flags, directory offset, digest offset, segments offset,
# file size, record count
HEADER = struct.Struct("<8sIIIIQQQQQ")
HEADER_SIZE = HEADER.size
DIR_ENTRY = np.dtype([("offset", "<u8"), ("count", "<u4"), ("crc", "<u4")])
DIR_ENTRY_SIZE = DIR_ENTRY.itemsize

# Flags of a record. A reference (incremental saves) names a file of another committed
# checkpoint in the manifest's `refs` list instead of one of the writer's data files; a codec
# compresses every checksum block on its own (see docs/format.md). Readers refuse what they
# do not implement.
FLAG_REFERENCE = 1
CODEC_SHIFT = 8
CODEC_MASK = 0xFF << CODEC_SHIFT
CODECS = {0: "none", 1: "zstd", 2: "zstd+shuffle"}
# Header flags. With FILE_HASHES every segment is followed by its content hash table: one
# HASH_SIZE-byte blake2b digest of each chunk's bytes, in record order, then a u32 crc32c of
# the table continued from the segment's checksum. Readers that do not use the hashes skip
# them: the directory still points at the records (see docs/format.md).
FILE_HASHES = 1
HASH_SIZE = 16
# Bits 8-15 of the header flags name the hash function (with FILE_HASHES).
HASH_SHIFT = 8
HASHES = {1: "xxh3-128", 2: "blake2b-128"}

RECORD_FIXED = np.dtype(
    [
        ("file", "<u4"),  # the writer's data file number (or refs index with FLAG_REFERENCE)
        ("flags", "<u4"),
        ("offset", "<u8"),  # first byte of the chunk in that file
        ("nbytes", "<u8"),  # bytes of the chunk (C order of its box)
        ("block", "<u4"),  # checksum block size
        ("nblocks", "<u4"),
        ("crc_offset", "<u8"),  # nblocks crc32c values (uint32) in the same file
    ]
)
assert HEADER_SIZE == 64 and DIR_ENTRY_SIZE == 16 and RECORD_FIXED.itemsize == 40


@functools.cache  # (making a structured dtype costs ~50 us; a save asks once per leaf)
def record_dtype(ndim: int) -> np.dtype:
    """One chunk record of an array with `ndim` axes."""
    names = RECORD_FIXED.names or ()
    fields = [(n, RECORD_FIXED.fields[n][0]) for n in names]  # type: ignore[index]
    return np.dtype([*fields, ("start", "<i8", (ndim,)), ("stop", "<i8", (ndim,))])


def segment_crc(data: bytes | memoryview, process: int, leaf: int, salt: int) -> int:
    """The checksum of leaf `leaf`'s segment of process `process`; `salt`: the record
    file's name key from 2.1 on (format.binding), 0 in 2.0."""
    return crc32c(data, crc32c(struct.pack("<II", process, leaf), salt))


@dataclass(frozen=True)
class Records:
    """The records of one leaf from one process, as columns."""

    starts: np.ndarray  # (n, ndim) int64
    stops: np.ndarray
    file: np.ndarray  # (n,) the writer's file number
    flags: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    block: np.ndarray
    nblocks: np.ndarray
    crc_offset: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)


class ChunkRecord(NamedTuple):
    """One chunk's record as its writer makes it: the fields of RECORD_FIXED, then its box.

    A NamedTuple, not a dataclass: a save makes one per chunk (tens of thousands for a
    state of many small arrays), and NumPy takes it as the record's tuple as it is."""

    file: int  # the writer's data file number (or refs index with FLAG_REFERENCE)
    flags: int
    offset: int
    nbytes: int
    block: int
    nblocks: int
    crc_offset: int  # where its tables start: checksums (block offsets first if compressed)
    start: list[int]
    stop: list[int]

    @property
    def codec(self) -> int:
        return codec_of(self.flags)

    def tables(self) -> int:
        """Bytes of the tables after the chunk's data: its checksums, and for a compressed
        chunk its block offsets first."""
        return packed_tables(self.nblocks) if self.codec else 4 * self.nblocks

    def end(self) -> int:
        """Where the next chunk starts in the file."""
        return self.crc_offset + self.tables()


def codec_of(flags: int) -> int:
    """The codec number in a record's flags (0: stored plain)."""
    return (int(flags) & CODEC_MASK) >> CODEC_SHIFT


def codecs_of(flags: np.ndarray) -> np.ndarray:
    """`codec_of` of a column of records' flags."""
    return (flags.astype(np.int64) & CODEC_MASK) >> CODEC_SHIFT


def packed_tables(nblocks: int) -> int:
    """Bytes of a compressed chunk's tables: nblocks + 1 u64 block offsets, then nblocks
    crc32c values."""
    return 8 * (nblocks + 1) + 4 * nblocks


def records_of(rows: Sequence[tuple[Any, ...]], ndim: int) -> np.ndarray:
    """ChunkRecords (or rows of the same fields) of one leaf as structured records
    (record_dtype), sorted by box."""
    out = np.zeros(len(rows), record_dtype(ndim))
    for i, r in enumerate(rows):
        out[i] = r
    if len(out) > 1 and ndim:
        out = out[np.lexsort(out["start"].T[::-1])]
    return out


DIGEST = np.dtype([("description", "<u4"), ("value", "<u4")])


def encode(
    process: int,
    ndims: list[int],
    segments: dict[int, np.ndarray],
    digests: np.ndarray,
    hashes: dict[int, np.ndarray] | None = None,
    hash_id: int = 0,
    *,
    salt: int,
) -> bytes:
    """A record file: `segments` maps leaf number to its structured records (record_dtype);
    `digests` has one DIGEST row per leaf; `hashes`, when given, maps every leaf of
    `segments` to its chunks' content hashes ((n, HASH_SIZE) uint8, in record order);
    `salt`: the file's name key (format.binding), which its segment checksums start from."""
    n = len(ndims)
    directory = np.zeros(n, DIR_ENTRY)
    parts: list[Any] = [np.ascontiguousarray(digests, DIGEST).tobytes()]
    digest_at = HEADER_SIZE + n * DIR_ENTRY_SIZE
    pos = digest_at + n * DIGEST.itemsize
    leaves = sorted(segments)
    offsets, counts, crcs = [], [], []
    prefix = struct.Struct("<II").pack
    for leaf in leaves:
        recs = segments[leaf]
        want = record_dtype(ndims[leaf])
        if recs.dtype is not want and recs.dtype != want:
            raise ValueError(f"records of leaf {leaf} have the wrong layout")
        raw = recs if recs.flags.c_contiguous else np.ascontiguousarray(recs)
        crc = _crc32c.crc32c(raw.data, _crc32c.crc32c(prefix(process, leaf), salt))
        offsets.append(pos)
        counts.append(len(recs))
        crcs.append(crc)
        parts.append(raw)
        pos += recs.nbytes
        if hashes is not None:
            table = np.ascontiguousarray(hashes[leaf], np.uint8).tobytes()
            if len(table) != HASH_SIZE * len(recs):
                raise ValueError(f"hashes of leaf {leaf} do not match its records")
            parts.append(table + struct.pack("<I", crc32c(table, crc)))
            pos += len(table) + 4
    if leaves:
        at = np.asarray(leaves, np.int64)
        directory["offset"][at] = offsets
        directory["count"][at] = counts
        directory["crc"][at] = crcs
    header = HEADER.pack(
        RECORD_MAGIC, RECORD_VERSION, process, n, (FILE_HASHES | hash_id << HASH_SHIFT) if hashes is not None else 0,
        HEADER_SIZE, digest_at,
        digest_at + n * DIGEST.itemsize, pos, sum(counts),
    )  # fmt: skip
    return header + directory.tobytes() + b"".join(parts)


def sorted_segments(
    leaf: np.ndarray,
    fixed: np.ndarray,
    starts: Sequence[Any],
    stops: Sequence[Any],
    ndims: Sequence[int],
) -> dict[int, np.ndarray]:
    """Chunk records given as columns (per chunk: its leaf, its RECORD_FIXED fields, its
    box) as the segments of `encode`: per leaf its structured records, sorted by box,
    chunks of equal boxes in the order given. The same segments as `records_of` of each
    leaf's rows, built for all leaves at once."""
    out: dict[int, np.ndarray] = {}
    if not len(leaf):
        return out
    leaf = np.asarray(leaf, np.int64)
    nd = np.asarray(ndims, np.int64)[leaf]
    for d in np.unique(nd).tolist():
        idx = np.flatnonzero(nd == d)
        recs = np.zeros(len(idx), record_dtype(d))
        for name in RECORD_FIXED.names or ():
            recs[name] = fixed[name][idx]
        if d:
            pick = idx.tolist()
            recs["start"] = _boxes([starts[i] for i in pick], d)
            recs["stop"] = _boxes([stops[i] for i in pick], d)
            keys = recs["start"].T[::-1]
            order = np.lexsort((*keys, leaf[idx]))
        else:
            order = np.argsort(leaf[idx], kind="stable")
        recs, of = recs[order], leaf[idx][order]
        cut = np.flatnonzero(np.diff(of)) + 1
        bounds = [0, *cut.tolist(), len(of)]
        for a, b in itertools.pairwise(bounds):
            out[int(of[a])] = recs[a:b]
    return out


def _boxes(rows: list[Any], ndim: int) -> np.ndarray:
    """(n, ndim) int64 of box corners given as arrays or lists of ndim ints each."""
    try:  # int64 arrays (a plan's rows), joined as bytes: no call per row
        flat = np.frombuffer(b"".join(rows), np.int64)
    except TypeError:  # lists of ints among them
        flat = np.empty(0, np.int64)
    if len(flat) != len(rows) * ndim or not all(
        type(r) is np.ndarray and r.dtype == np.int64 for r in rows
    ):
        flat = np.concatenate(rows, dtype=np.int64)
    return flat.reshape(len(rows), ndim)


def decode_header(data: bytes, where: str, process: int, leaves: int) -> int:
    """Checks the header of a record file; returns the file size it states."""
    if len(data) < HEADER_SIZE:
        raise CorruptCheckpointError(f"{where}: record file header is truncated")
    magic, version, proc, n, _flags, d, g, _s, size, _count = HEADER.unpack_from(data)
    if magic != RECORD_MAGIC or version != RECORD_VERSION:
        raise CorruptCheckpointError(f"{where}: not a snapshard v2 record file")
    if proc != process or n != leaves or d != HEADER_SIZE or g != d + n * DIR_ENTRY_SIZE:
        raise CorruptCheckpointError(
            f"{where}: record file header says process {proc} with {n} leaves, the manifest "
            f"says process {process} with {leaves}"
        )
    return int(size)


def directory_offset(leaf: int) -> int:
    return HEADER_SIZE + leaf * DIR_ENTRY_SIZE


def staged_digests(data: bytes) -> np.ndarray | None:
    """The digests of a record file just written (the committer's check that processes
    saved the same tree), its leaf count taken from its own header; None if it is short."""
    if len(data) < HEADER_SIZE:
        return None
    n = int(HEADER.unpack_from(data)[3])
    a = directory_offset(n)
    b = a + n * DIGEST.itemsize
    return np.frombuffer(data[a:b], DIGEST) if len(data) >= b else None


def decode_entries(data: bytes) -> np.ndarray:
    return np.frombuffer(data, DIR_ENTRY)


def check_entries(
    entries: np.ndarray, ndim: np.ndarray, file_size: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, byte lengths) of the segments directory `entries` point to (leaves of
    `ndim` axes each), every one bounded by the file."""
    count = entries["count"].astype(np.int64)
    offset = entries["offset"].astype(np.int64)
    length = count * (RECORD_FIXED.itemsize + 16 * ndim)
    bad = (count > 0) & ((offset < HEADER_SIZE) | (offset + length > file_size))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise CorruptCheckpointError(
            f"{where}: directory entry points outside the record file "
            f"({int(count[i])} records at {int(offset[i])})"
        )
    return offset, length


def decode_segment(
    data: bytes | memoryview,
    entry: np.void,
    ndim: int,
    process: int,
    leaf: int,
    where: str,
    salt: int,
) -> Records:
    """The records of one segment, after checking its crc32c (`salt`: see segment_crc)."""
    if segment_crc(data, process, leaf, salt) != int(entry["crc"]):
        raise CorruptCheckpointError(f"{where}: chunk records fail their checksum")
    recs = np.frombuffer(data, record_dtype(ndim))
    return Records(
        starts=recs["start"].astype(np.int64).reshape(len(recs), ndim),
        stops=recs["stop"].astype(np.int64).reshape(len(recs), ndim),
        file=recs["file"].astype(np.int64),
        flags=recs["flags"].astype(np.int64),
        offset=recs["offset"].astype(np.int64),
        nbytes=recs["nbytes"].astype(np.int64),
        block=recs["block"].astype(np.int64),
        nblocks=recs["nblocks"].astype(np.int64),
        crc_offset=recs["crc_offset"].astype(np.int64),
    )


def header_flags(data: bytes) -> int:
    """The flags of a record file's header (FILE_HASHES)."""
    return int(HEADER.unpack_from(data)[4])


def decode_hashes(data: bytes | memoryview, entry: np.void, ndim: int, where: str) -> np.ndarray:
    """The content hashes of one segment ((count, HASH_SIZE) uint8) from the bytes that follow
    its records, checked against their crc32c (continued from the segment's checksum)."""
    count = int(entry["count"])
    table = bytes(data[: HASH_SIZE * count])
    tail = bytes(data[HASH_SIZE * count : HASH_SIZE * count + 4])
    if len(tail) != 4 or struct.unpack("<I", tail)[0] != crc32c(table, int(entry["crc"])):
        raise CorruptCheckpointError(f"{where}: the chunks' content hashes fail their checksum")
    return np.frombuffer(table, np.uint8).reshape(count, HASH_SIZE)
