"""Chunk encoding: how a chunk's bytes lie in its data file, plain or compressed, and how
they are written (read back compressed: compressed_reads.py; see docs/format.md).

A plain chunk is its box's C-order bytes, then one crc32c per checksum block. A compressed
chunk (record codec bits) stores each checksum block compressed on its own, back to back at
`offset`; at `crc_offset` lie `nblocks + 1` u64 offsets of the compressed blocks (relative
to `offset`), then the `nblocks` crc32c values of the uncompressed blocks, so the checksum
block stays the unit of random access. Checksums are stored XOR the chunk's key, bound to
its file and offset (format.binding). A save compresses a large chunk's blocks in groups in
the codec threads (compression.PARALLEL_MIN) while its writer thread writes them out in
order.

Codec 1 is zstd; codec 2 is zstd after a byte shuffle of each block (all first bytes of the
elements, then all second bytes, ...), which groups the slowly varying sign and exponent
bytes of floating-point values.

Pure encoding: the storage is only written through the writer given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..checksum import block_crcs, crc32c
from . import compression as z
from .binding import chunk_key
from .chunks import checksum_block
from .records import CODEC_SHIFT, ChunkRecord

if TYPE_CHECKING:
    from ..storage import FileWriter

NONE, ZSTD, ZSTD_SHUFFLE = 0, 1, 2
# The values of SaveOptions.compression and the codec each gives (see codec_for).
COMPRESSION_CODECS = {
    None: NONE,
    "zstd": ZSTD,
    "zstd-noshuffle": ZSTD,
    "zstd+shuffle": ZSTD_SHUFFLE,
}
COMPRESSIONS = tuple(COMPRESSION_CODECS)
DEFAULT_LEVEL = 1
_WRITE_PIECE = 16 << 20  # a large plain chunk goes out in pieces of this many bytes


def codec_for(compression: str | None, dtype: np.dtype) -> int:
    """The codec of a chunk of `dtype` under a save's `compression` option: 'zstd' (or
    'zstd-noshuffle') compresses the bytes as they are; 'zstd+shuffle' byte-shuffles types
    wider than a byte first. None (the default of `save`) compresses nothing. The shuffle
    saved 0.3-0.4% more bytes on trained-like floating-point state for 10-70% more time
    (design.md, "Compression"), so 'zstd' does not shuffle."""
    codec = COMPRESSION_CODECS.get(compression, -1)
    if codec < 0:
        raise ValueError(
            f"unknown compression {compression!r}; expected one of "
            f"{', '.join(map(repr, COMPRESSIONS))}"
        )
    return ZSTD if codec == ZSTD_SHUFFLE and dtype.itemsize == 1 else codec


def shuffle(block: np.ndarray, itemsize: int) -> np.ndarray:
    return block.reshape(-1, itemsize).T.reshape(-1) if itemsize > 1 else block


def unshuffle(block: np.ndarray, itemsize: int) -> np.ndarray:
    return block.reshape(itemsize, -1).T.reshape(-1) if itemsize > 1 else block


def chunk_span(nbytes: int) -> int:
    """Bytes a plain chunk of `nbytes` takes in its file: the data, then its checksums."""
    return nbytes + 4 * -(-nbytes // checksum_block(nbytes))


def write_chunk(
    writer: FileWriter,
    data: np.ndarray,
    start: Any,
    stop: Any,
    file: int,
    offset: int,
    *,
    file_key: int,
    codec: int = NONE,
    level: int = DEFAULT_LEVEL,
) -> ChunkRecord:
    """Append the chunk of box [start, stop) holding `data` to `writer` at `offset` of data
    file number `file` (`file_key`: the file's name key), plain or compressed with `codec`;
    returns its record."""
    arr = np.ascontiguousarray(data)
    raw = arr.reshape(-1).view(np.uint8)
    block = checksum_block(len(raw))
    key = chunk_key(file_key, offset)
    if codec:
        nblocks, packed = _write_packed(writer, raw, block, key, codec, level, arr.dtype.itemsize)
    else:
        nblocks, packed = _write_plain(writer, raw.data, block, key), len(raw)
    return ChunkRecord(
        file, codec << CODEC_SHIFT, offset, len(raw), block, nblocks, offset + packed,
        [int(x) for x in start], [int(x) for x in stop],
    )  # fmt: skip


def _write_plain(writer: FileWriter, raw: memoryview, block: int, key: int) -> int:
    """The bytes, checksummed block by block as they go out, then the checksums; returns
    the number of blocks."""
    if 0 < len(raw) <= block:  # one block (every small chunk): no per-block arrays
        crc = crc32c(raw)
        writer.write(raw)
        writer.write(memoryview((crc ^ key).to_bytes(4, "little")))
        return 1
    piece = max(block, (_WRITE_PIECE // block) * block)
    crcs: list[int] = []
    for a in range(0, len(raw), piece):
        crcs.extend(block_crcs(raw[a : a + piece], block))
        writer.write(raw[a : a + piece])
    bound = np.asarray(crcs, dtype="<u4") ^ np.uint32(key)
    writer.write(memoryview(bound.astype("<u4").tobytes()))
    return len(crcs)


def _write_packed(
    writer: FileWriter, raw: np.ndarray, block: int, key: int, codec: int, level: int,
    itemsize: int,
) -> tuple[int, int]:  # fmt: skip
    """Each block compressed on its own, then the blocks' offsets and checksums; returns
    the number of blocks and the bytes of the compressed ones. A large chunk's blocks are
    checksummed and compressed in the codec threads, group by group, while this thread
    writes them in order."""
    n = len(raw)
    nblocks = -(-n // block)

    def pack(g0: int, g1: int) -> tuple[list[bytes], list[int]]:
        out, crcs = [], []
        for b in range(g0, g1):
            piece = raw[b * block : (b + 1) * block]
            crcs.append(crc32c(piece.data))
            if codec == ZSTD_SHUFFLE:
                piece = shuffle(piece, itemsize)
            out.append(z.compress(piece.data, level))
        return out, crcs

    offsets = [0]
    crcs: list[int] = []
    for packed, sums in z.in_parallel(z.groups(0, nblocks, block), n, pack):
        writer.write(memoryview(b"".join(packed)))  # one write per group, not per block
        for frame in packed:
            offsets.append(offsets[-1] + len(frame))
        crcs.extend(sums)
    bound = np.asarray(crcs, "<u4") ^ np.uint32(key)
    writer.write(memoryview(np.asarray(offsets, "<u8").tobytes() + bound.astype("<u4").tobytes()))
    return len(crcs), offsets[-1]
