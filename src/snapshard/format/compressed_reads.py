"""Reading a compressed chunk (laid out as encoding.py describes).

A read of bytes [a, b) of a compressed chunk fetches the offsets and checksums of the
blocks it touches, then exactly those compressed blocks (a whole chunk: all of it in one
read), decompresses each and verifies it against its checksum, and keeps what was asked
for. A block wholly inside a read is decompressed straight into the destination buffer and
checksummed there (no copy); only the first and last block of a partial read, and blocks
spanning two destination pieces, go through a per-thread scratch block. A large range
(compression.PARALLEL_MIN) is split into groups of blocks that the codec threads
decompress at once. Compressed reads go through a reused per-thread buffer of at most
WINDOW bytes rather than fresh memory per read.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from ..checksum import crc32c
from ..errors import ChecksumMismatchError, CorruptCheckpointError, SnapshardError
from . import compression as z
from .encoding import ZSTD, ZSTD_SHUFFLE, unshuffle
from .records import packed_tables

if TYPE_CHECKING:
    from ..storage import Storage

# The most compressed bytes one read fetches at a time: bounds the scratch of each reader.
WINDOW = 64 << 20


@dataclass(frozen=True)
class PackedChunk:
    """A compressed chunk as its record places it, with what a reader names it by."""

    name: str  # its data file
    offset: int
    nbytes: int  # uncompressed
    block: int
    crc_offset: int  # where its tables start
    codec: int
    itemsize: int  # of its elements (the shuffle's unit)
    key: int  # its checksums' key (format.binding)
    leaf: str = ""
    chunk: int = 0

    @property
    def nblocks(self) -> int:
        return -(-self.nbytes // self.block)


class _Output:
    """Bytes [0, total) of a read, laid over consecutive buffers."""

    def __init__(self, buffers: Sequence[memoryview]):
        self.bufs = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
        self.ends = list(itertools.accumulate(len(b) for b in self.bufs))

    def view(self, a: int, b: int) -> memoryview | None:
        """Output bytes [a, b) as one buffer's slice, or None where they span buffers."""
        i = bisect.bisect_right(self.ends, a)
        if i == len(self.bufs) or b > self.ends[i]:
            return None
        base = self.ends[i] - len(self.bufs[i])
        return self.bufs[i][a - base : b - base]

    def put(self, a: int, piece: memoryview) -> None:
        """Copy `piece` to output bytes [a, a + len(piece))."""
        i = bisect.bisect_right(self.ends, a)
        while len(piece):
            base = self.ends[i] - len(self.bufs[i])
            n = min(len(piece), self.ends[i] - a)
            self.bufs[i][a - base : a - base + n] = piece[:n]
            piece, a, i = piece[n:], a + n, i + 1


@dataclass(frozen=True)
class _Read:
    """One read of bytes [start, stop) of a chunk: blocks b0.. it touches, their compressed
    offsets and checksums (indexed from b0), and blocks [full0, full1) (from b0) that lie
    wholly inside it and take the fast path."""

    chunk: PackedChunk
    where: str
    start: int
    stop: int
    b0: int
    ends: list[int]
    crcs: list[int] | None
    full0: int
    full1: int
    out: _Output

    def failed(self, b: int, problem: str) -> CorruptCheckpointError:
        c = self.chunk
        return CorruptCheckpointError(
            f"{self.where}: leaf {c.leaf!r}, chunk {c.chunk}: block {b} {problem}"
        )

    def check(self, b: int, plain: memoryview | bytes, expected: int) -> None:
        actual = crc32c(plain)
        if actual != expected:
            raise ChecksumMismatchError(
                file=self.where, leaf=self.chunk.leaf, chunk=self.chunk.chunk, block=b,
                expected=expected, actual=actual,
            )  # fmt: skip


def read_packed(
    storage: Storage,
    chunk: PackedChunk,
    start: int,
    stop: int,
    buffers: Sequence[memoryview],
    *,
    verify: bool,
) -> int:
    """Fill `buffers` with bytes [start, stop) of a compressed chunk, decompressing only the
    blocks they touch (verifying each with `verify` against the stored checksums); returns
    the bytes read from storage. A whole chunk is one read (blocks, offsets and checksums
    lie back to back); a part of one reads its offsets, its checksums, then its blocks."""
    where = f"{storage.url}/{chunk.name}"
    if chunk.codec not in (ZSTD, ZSTD_SHUFFLE):
        raise SnapshardError(f"{where}: unknown codec {chunk.codec}")
    if stop <= start:
        return 0
    block, nblocks = chunk.block, chunk.nblocks
    b0, b1 = start // block, -(-stop // block)
    packed, ends, crcs, read = _tables(storage, chunk, b0, b1, verify)
    if ends[0] < 0 or np.any(np.diff(ends) < 0) or chunk.offset + int(ends[-1]) > chunk.crc_offset:
        raise CorruptCheckpointError(f"{where}: malformed compressed block offsets")
    full0, full1 = -(-start // block) - b0, (stop // block if stop < chunk.nbytes else nblocks) - b0
    if chunk.codec != ZSTD or not z.has_decompressor():
        full0 = full1 = 0  # the fast path is zstd's alone
    r = _Read(
        chunk, where, start, stop, b0, [int(x) for x in ends.tolist()],
        [int(x) ^ chunk.key for x in crcs.tolist()] if verify else None, full0, full1,
        _Output(buffers),
    )  # fmt: skip
    return read + _unpack_windows(storage, r, packed, ends, b1 - b0)


def _tables(
    storage: Storage, chunk: PackedChunk, b0: int, b1: int, verify: bool
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray, int]:
    """The compressed offsets (int64) and stored checksums of blocks b0..b1, the chunk's
    packed blocks too where the read is the whole chunk (one read), and the bytes read."""
    nblocks, offset, crc_offset = chunk.nblocks, chunk.offset, chunk.crc_offset
    packed_size = crc_offset - offset  # of all the chunk's blocks
    if b0 == 0 and b1 == nblocks and 0 <= packed_size <= WINDOW:
        tables = packed_tables(nblocks)
        buf = z.scratch("packed", packed_size + tables, WINDOW + packed_tables(256))
        storage.read_into(chunk.name, offset, [buf.data])
        offs = np.frombuffer(buf, "<u8", nblocks + 1, packed_size)
        crcs = np.frombuffer(buf, "<u4", nblocks, packed_size + 8 * (nblocks + 1))
        return buf[:packed_size], offs.astype(np.int64), crcs, len(buf)
    offs = np.empty(b1 - b0 + 1, "<u8")
    crcs = np.empty(b1 - b0, "<u4")
    storage.read_into(chunk.name, crc_offset + 8 * b0, [offs.view(np.uint8).data])
    read = offs.nbytes
    if verify:
        at = crc_offset + 8 * (nblocks + 1) + 4 * b0
        storage.read_into(chunk.name, at, [crcs.view(np.uint8).data])
        read += crcs.nbytes
    return None, offs.astype(np.int64), crcs, read


def _unpack_windows(
    storage: Storage, r: _Read, packed: np.ndarray | None, ends: np.ndarray, count: int
) -> int:
    """Decompress the read's `count` blocks, window by window (compressed bytes of at most
    WINDOW, at least one block); returns the bytes read for them (0 when `packed` holds
    the whole chunk already)."""
    c, read, k = r.chunk, 0, 0
    while k < count:
        lo = int(ends[k])
        e = int(np.searchsorted(ends, lo + WINDOW, side="right")) - 1
        e = min(max(e, k + 1), count)
        if packed is None:
            window = z.scratch("packed", int(ends[e]) - lo, WINDOW)
            storage.read_into(c.name, c.offset + lo, [window.data])
            read += len(window)
        else:
            window = packed[lo : int(ends[e])]
        size = min(r.stop, (r.b0 + e) * c.block) - max(r.start, (r.b0 + k) * c.block)
        for _ in z.in_parallel(z.groups(k, e, c.block), size, partial(_unpack, r, window, lo)):
            pass
        k = e
    return read


def _unpack(r: _Read, window: np.ndarray, lo: int, g0: int, g1: int) -> None:
    """Blocks g0..g1 (from b0) of the read, whose compressed bytes `window` holds from `lo`."""
    j = g0
    while j < g1:
        if r.full0 <= j < r.full1:
            j = _unpack_whole(r, window.data, lo, j, min(g1, r.full1))
            if j >= min(g1, r.full1):
                continue
        _unpack_block(r, window[r.ends[j] - lo : r.ends[j + 1] - lo].data, j)
        j += 1


def _unpack_whole(r: _Read, window: memoryview, lo: int, j: int, stop_j: int) -> int:
    """Codec 1, blocks j.. (from b0) wholly inside the read and inside one output buffer, in
    a tight loop: decompress, check the size and the checksum, copy into place. Returns the
    first block it left (stop_j, or one that spans two buffers: the caller's)."""
    zstd, d = z.backend(), z.decompressor()
    c, out = r.chunk, r.out
    at = (r.b0 + j) * c.block - r.start
    i = bisect.bisect_right(out.ends, at)
    buf, base, end = out.bufs[i], out.ends[i] - len(out.bufs[i]), out.ends[i]
    while j < stop_j:
        b = r.b0 + j
        size = min(c.block, c.nbytes - b * c.block)
        if at + size > end:
            break
        frame = window[r.ends[j] - lo : r.ends[j + 1] - lo]
        try:
            declared = zstd.frame_content_size(frame)  # -1: not in the frame header
            if declared not in (-1, size):
                raise ValueError(f"the frame declares {declared} bytes")
            plain = d.decompress(frame, max_output_size=size)
        except Exception as e:  # the backend's own error types
            raise r.failed(b, f"does not decompress ({e})") from None
        if len(plain) != size:
            raise r.failed(b, f"decompresses to {len(plain)} bytes, not {size}")
        if r.crcs is not None:
            r.check(b, plain, r.crcs[j])
        buf[at - base : at - base + size] = plain
        at += size
        j += 1
    return j


def _unpack_block(r: _Read, frame: memoryview, j: int) -> None:
    """Decompress block j (from b0), check it against its checksum, and put the bytes of
    the read it holds into the output."""
    c, out = r.chunk, r.out
    b = r.b0 + j
    size = min(c.block, c.nbytes - b * c.block)
    a, end = max(r.start - b * c.block, 0), min(r.stop - b * c.block, size)
    at = b * c.block + a - r.start  # where its bytes go in the output
    direct = out.view(at, at + size) if a == 0 and end == size else None
    plain = (
        direct if direct is not None and c.codec == ZSTD else z.scratch("block", size, 4 << 20).data
    )
    try:
        got = z.decompress_into(frame, plain)
    except Exception as e:  # the backend's own error types
        raise r.failed(b, f"does not decompress ({e})") from None
    if got != size:
        more = "more than " if got > size else ""
        raise r.failed(b, f"decompresses to {more}{min(got, size)} bytes, not {size}")
    if c.codec == ZSTD_SHUFFLE:
        src = np.frombuffer(plain, np.uint8)
        if direct is not None:
            np.copyto(np.frombuffer(direct, np.uint8).reshape(-1, c.itemsize).T,
                      src.reshape(c.itemsize, -1))  # fmt: skip
            plain = direct
        else:
            plain = unshuffle(src, c.itemsize).data
    if r.crcs is not None:
        r.check(b, plain, r.crcs[j])
    if plain is not direct:
        out.put(at, plain[a:end])
