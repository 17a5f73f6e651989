"""Per-block compression that keeps the checksum block the unit of random access.

A compressed chunk (record codec bits, see docs/format.md) stores each checksum block
compressed on its own, back to back at `offset`; at `crc_offset` lie `nblocks + 1` u64
offsets of the compressed blocks (relative to `offset`), then the `nblocks` crc32c values of
the uncompressed blocks. A read of bytes [a, b) of the chunk fetches the offsets and
checksums of the blocks it touches, then exactly those compressed blocks, decompresses and
verifies them one by one, and copies out what was asked for.

Codec 1 is zstd; codec 2 is zstd after a byte shuffle of each block (all first bytes of the
elements, then all second bytes, …), which groups the slowly varying sign and exponent bytes
of floating-point values. zstd comes from the `zstandard` package (the `compress` extra) or
Python's own `compression.zstd` (3.14+).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .checksum import crc32c
from .errors import ChecksumMismatchError, CorruptCheckpointError, SnapshardError
from .format import checksum_block
from .format import records as rec
from .storage import FileWriter, Storage

NONE, ZSTD, ZSTD_SHUFFLE = 0, 1, 2
NAMES = {"zstd": ZSTD, "zstd+shuffle": ZSTD_SHUFFLE}
DEFAULT_LEVEL = 1

_local = threading.local()


def _backend() -> Any:
    try:
        import zstandard

        return zstandard
    except ImportError:
        pass
    try:
        from compression import zstd  # type: ignore[import-not-found,unused-ignore]

        return zstd
    except ImportError:
        raise SnapshardError(
            "compressed checkpoints need zstd: install snapshard[compress] (the zstandard package)"
        ) from None


def available() -> bool:
    try:
        _backend()
    except SnapshardError:
        return False
    return True


def _compress(data: memoryview | bytes, level: int) -> bytes:
    z = _backend()
    if hasattr(z, "ZstdCompressor"):
        key = ("c", level)
        c = getattr(_local, "c", {}).get(key)
        if c is None:
            _local.c = {**getattr(_local, "c", {}), key: (c := z.ZstdCompressor(level=level))}
        return bytes(c.compress(data))
    return bytes(z.compress(bytes(data), level=level))


def _decompress(data: bytes, size: int) -> bytes:
    z = _backend()
    if hasattr(z, "ZstdDecompressor"):
        d = getattr(_local, "d", None)
        if d is None:
            d = _local.d = z.ZstdDecompressor()
        return bytes(d.decompress(data, max_output_size=size))
    return bytes(z.decompress(data))


def codec_for(compression: str | None, dtype: np.dtype) -> int:
    """The codec of a chunk of `dtype` under a save's `compression` option: 'zstd' (or
    'zstd-noshuffle') compresses the bytes as they are; 'zstd+shuffle' byte-shuffles types
    wider than a byte first. The shuffle saved 0.3-0.4% more bytes on trained-like
    floating-point state for 10-70% more time (design.md, "Compression"): not the default."""
    if compression is None:
        return NONE
    if compression in ("zstd", "zstd-noshuffle"):
        return ZSTD
    if compression == "zstd+shuffle":
        return ZSTD_SHUFFLE if dtype.itemsize > 1 else ZSTD
    raise ValueError(
        f"unknown compression {compression!r} (None, 'zstd', 'zstd+shuffle', 'zstd-noshuffle')"
    )


def shuffle(block: np.ndarray, itemsize: int) -> np.ndarray:
    return block.reshape(-1, itemsize).T.reshape(-1) if itemsize > 1 else block


def unshuffle(block: np.ndarray, itemsize: int) -> np.ndarray:
    return block.reshape(itemsize, -1).T.reshape(-1) if itemsize > 1 else block


def write_chunk(
    writer: FileWriter,
    data: np.ndarray,
    start: Any,
    stop: Any,
    file: int,
    offset: int,
    codec: int,
    level: int = DEFAULT_LEVEL,
) -> tuple[Any, ...]:
    """Append a compressed chunk (blocks, then offsets and checksums) to `writer`; returns
    its record fields like saving.write_chunk."""
    arr = np.ascontiguousarray(data)
    itemsize = arr.dtype.itemsize
    raw = arr.reshape(-1).view(np.uint8)
    n = len(raw)
    block = checksum_block(n)
    offsets = [0]
    crcs = []
    for a in range(0, n, block):
        piece = raw[a : a + block]
        crcs.append(crc32c(piece.data))
        if codec == ZSTD_SHUFFLE:
            piece = shuffle(piece, itemsize)
        z = _compress(piece.data, level)
        writer.write(memoryview(z))
        offsets.append(offsets[-1] + len(z))
    tail = np.asarray(offsets, "<u8").tobytes() + np.asarray(crcs, "<u4").tobytes()
    writer.write(memoryview(tail))
    return (
        file, codec << rec.CODEC_SHIFT, offset, n, block, len(crcs), offset + offsets[-1],
        [int(x) for x in start], [int(x) for x in stop],
    )  # fmt: skip


def row_end(row: tuple[Any, ...]) -> int:
    """Where the next chunk starts in the file, after the chunk `row` describes."""
    _file, flags, _offset, _nbytes, _block, nblocks, crc_offset, *_ = row
    if (flags & rec.CODEC_MASK) >> rec.CODEC_SHIFT:
        return int(crc_offset) + 8 * (nblocks + 1) + 4 * nblocks
    return int(crc_offset) + 4 * nblocks


def codec_of(flags: int) -> int:
    return (int(flags) & rec.CODEC_MASK) >> rec.CODEC_SHIFT


def table_end(nblocks: int) -> int:
    """Bytes of a compressed chunk's offsets and checksums."""
    return 8 * (nblocks + 1) + 4 * nblocks


def read_range(
    storage: Storage,
    name: str,
    *,
    offset: int,
    nbytes: int,
    block: int,
    crc_offset: int,
    codec: int,
    itemsize: int,
    start: int,
    stop: int,
    buffers: Sequence[memoryview],
    verify: bool,
    leaf: str = "",
    chunk: int = 0,
) -> int:
    """Fill `buffers` with bytes [start, stop) of a compressed chunk, decompressing only the
    blocks they touch (verifying each with `verify`); returns the bytes read from storage."""
    if codec not in (ZSTD, ZSTD_SHUFFLE):
        raise SnapshardError(f"{storage.url}/{name}: unknown codec {codec}")
    nblocks = -(-nbytes // block)
    b0, b1 = start // block, -(-stop // block)
    if stop <= start:
        return 0
    offs = np.empty(b1 - b0 + 1, "<u8")
    crcs = np.empty(b1 - b0, "<u4")
    storage.read_into(name, crc_offset + 8 * b0, [offs.view(np.uint8).data])
    read = offs.nbytes
    if verify:
        storage.read_into(name, crc_offset + 8 * (nblocks + 1) + 4 * b0, [crcs.view(np.uint8).data])
        read += crcs.nbytes
    lo, hi = int(offs[0]), int(offs[-1])
    if np.any(np.diff(offs.astype(np.int64)) < 0) or offset + hi > crc_offset:
        raise CorruptCheckpointError(f"{storage.url}/{name}: malformed compressed block offsets")
    packed = np.empty(hi - lo, np.uint8)
    storage.read_into(name, offset + lo, [packed.data])
    read += packed.nbytes
    out = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
    oi, opos = 0, 0  # position in the output buffers
    for k, b in enumerate(range(b0, b1)):
        size = min(block, nbytes - b * block)
        z = packed[int(offs[k]) - lo : int(offs[k + 1]) - lo]
        try:
            plain = np.frombuffer(_decompress(z.tobytes(), size), np.uint8)
        except Exception as e:  # the backend's own error types
            raise CorruptCheckpointError(
                f"{storage.url}/{name}: leaf {leaf!r}, chunk {chunk}: block {b} does not "
                f"decompress ({e})"
            ) from None
        if len(plain) != size:
            raise CorruptCheckpointError(
                f"{storage.url}/{name}: leaf {leaf!r}, chunk {chunk}: block {b} decompresses "
                f"to {len(plain)} bytes, not {size}"
            )
        if codec == ZSTD_SHUFFLE:
            plain = unshuffle(plain, itemsize)
        if verify:
            got = crc32c(plain.data)
            if got != int(crcs[k]):
                raise ChecksumMismatchError(
                    file=f"{storage.url}/{name}", leaf=leaf, chunk=chunk, block=b,
                    expected=int(crcs[k]), actual=got,
                )  # fmt: skip
        a = max(start - b * block, 0)
        end = min(stop - b * block, size)
        piece = plain[a:end].data
        while len(piece):
            room = len(out[oi]) - opos
            n = min(room, len(piece))
            out[oi][opos : opos + n] = piece[:n]
            piece = piece[n:]
            opos += n
            if opos == len(out[oi]):
                oi, opos = oi + 1, 0
    return read
