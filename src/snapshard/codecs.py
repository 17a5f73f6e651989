"""Per-block compression that keeps the checksum block the unit of random access.

A compressed chunk (record codec bits, see docs/format.md) stores each checksum block
compressed on its own, back to back at `offset`; at `crc_offset` lie `nblocks + 1` u64
offsets of the compressed blocks (relative to `offset`), then the `nblocks` crc32c values of
the uncompressed blocks. A read of bytes [a, b) of the chunk fetches the offsets and
checksums of the blocks it touches, then exactly those compressed blocks (a whole chunk: all
of it in one read), decompresses each and verifies it against its checksum, and keeps what
was asked for.

Speed: a block that lies wholly inside a read is decompressed straight into the destination
buffer and checksummed there (no copy); only the first and last block of a partial read, and
blocks spanning two destination pieces, go through a per-thread scratch block. zstd and
crc32c release the GIL, so the restore's reader threads decompress in parallel, and a large
range (PARALLEL_MIN) is split into groups of blocks that the codec threads (one per core
of the process's share, `cpus.share`) decompress at once; a save compresses a large chunk's
blocks the same way while its writer thread writes them out in order. Compressed reads go
through a reused per-thread buffer of at most WINDOW bytes rather than fresh memory per read.

Codec 1 is zstd; codec 2 is zstd after a byte shuffle of each block (all first bytes of the
elements, then all second bytes, …), which groups the slowly varying sign and exponent bytes
of floating-point values. zstd comes from the `zstandard` package (the `compress` extra) or
Python's own `compression.zstd` (3.14+).
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np

from . import cpus
from .checksum import crc32c
from .errors import ChecksumMismatchError, CorruptCheckpointError, SnapshardError
from .format import checksum_block
from .format import records as rec
from .format.binding import chunk_key
from .storage import FileWriter, Storage

NONE, ZSTD, ZSTD_SHUFFLE = 0, 1, 2
# The values of SaveOptions.compression and the codec each gives (see codec_for).
COMPRESSION_CODECS = {None: NONE, "zstd": ZSTD, "zstd-noshuffle": ZSTD, "zstd+shuffle": ZSTD_SHUFFLE}
COMPRESSIONS = tuple(COMPRESSION_CODECS)
DEFAULT_LEVEL = 1

_local = threading.local()
_T = TypeVar("_T")


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


def _decompress_into(data: memoryview, out: memoryview) -> int:
    """Decompress the zstd frame `data` into `out` (straight into it where the backend can);
    returns how many bytes the frame holds, up to len(out) + 1 (more than fits is an error
    the caller reports)."""
    z = _backend()
    if hasattr(z, "ZstdDecompressor"):
        d = getattr(_local, "d", None)
        if d is None:
            d = _local.d = z.ZstdDecompressor()
        n = 0
        with d.stream_reader(data, read_size=max(1, len(data))) as r:
            while n < len(out):
                got = r.readinto(out[n:])
                if not got:
                    return n
                n += got
            return n + len(r.read(1))
    plain = z.decompress(bytes(data))
    if len(plain) == len(out):
        out[:] = plain
    return len(plain)


# Ranges of at least this many (uncompressed) bytes are split into groups of blocks that the
# codec threads compress or decompress in parallel; smaller ones stay in the calling thread.
PARALLEL_MIN = 8 << 20
_GROUP = 2 << 20  # uncompressed bytes per group (at least one block)
# The most compressed bytes one read fetches at a time: bounds the scratch of each reader.
WINDOW = 64 << 20

_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _threads() -> int:
    return min(cpus.share(), 32)


def _codec_pool() -> ThreadPoolExecutor | None:
    """The process's codec threads (one per core of its share, `cpus.share`; none on one
    core). zstd and crc32c release the GIL, so they compress and decompress in parallel.
    Made again after a fork."""
    global _pool
    n = _threads()
    if n < 2:
        return None
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(n, thread_name_prefix="snapshard-codec"))
        return _pool[1]


def _groups(first: int, stop: int, block: int) -> list[tuple[int, int]]:
    per = max(1, _GROUP // max(block, 1))
    return [(g, min(g + per, stop)) for g in range(first, stop, per)]


def _in_parallel(
    groups: list[tuple[int, int]], nbytes: int, fn: Callable[[int, int], _T]
) -> Iterator[_T]:
    """fn(g0, g1) of every group, in order: in the codec threads (at most two per thread in
    flight, which bounds what waits to be consumed) when the range is large, else here."""
    pool = _codec_pool() if nbytes >= PARALLEL_MIN and len(groups) > 1 else None
    if pool is None:
        for g0, g1 in groups:
            yield fn(g0, g1)
        return
    ahead = 2 * _threads()
    pending: deque[Future[_T]] = deque()
    todo = iter(groups)
    try:
        for g0, g1 in itertools.islice(todo, ahead):
            pending.append(pool.submit(fn, g0, g1))
        while pending:
            result = pending.popleft().result()
            for g0, g1 in itertools.islice(todo, 1):
                pending.append(pool.submit(fn, g0, g1))
            yield result
    finally:  # an error (or the consumer's): let nothing run on after the caller's buffers
        for f in pending:
            f.cancel()
        wait(pending)


def _scratch(name: str, n: int, keep: int) -> np.ndarray:
    """n bytes of this thread's scratch `name`, reused by its next call rather than fresh
    memory (and its page faults) each time. Kept only up to `keep` bytes and only by the
    library's own threads (readers end with their load; codec threads keep a block at most);
    a caller's thread would hold it for good."""
    buf = getattr(_local, name, None)
    if buf is not None and len(buf) >= n:
        return buf[:n]
    buf = np.empty(n, np.uint8)
    if n <= keep and threading.current_thread().name.startswith("snapshard-"):
        setattr(_local, name, buf)
    return buf


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


def write_chunk(
    writer: FileWriter,
    data: np.ndarray,
    start: Any,
    stop: Any,
    file: int,
    offset: int,
    codec: int,
    level: int = DEFAULT_LEVEL,
    *,
    file_key: int,
) -> rec.ChunkRecord:
    """Append a compressed chunk (blocks, then offsets and checksums) to `writer`; returns
    its record fields like saving.write_chunk. The checksums are stored bound to the file
    (`file_key`, its name key) and the offset (format.binding). A large chunk's blocks are checksummed and
    compressed in the codec threads, group by group, while this thread writes them in order."""
    arr = np.ascontiguousarray(data)
    itemsize = arr.dtype.itemsize
    raw = arr.reshape(-1).view(np.uint8)
    n = len(raw)
    block = checksum_block(n)
    nblocks = -(-n // block)

    def pack(g0: int, g1: int) -> tuple[list[bytes], list[int]]:
        out, crcs = [], []
        for b in range(g0, g1):
            piece = raw[b * block : (b + 1) * block]
            crcs.append(crc32c(piece.data))
            if codec == ZSTD_SHUFFLE:
                piece = shuffle(piece, itemsize)
            out.append(_compress(piece.data, level))
        return out, crcs

    offsets = [0]
    crcs: list[int] = []
    for packed, sums in _in_parallel(_groups(0, nblocks, block), n, pack):
        writer.write(memoryview(b"".join(packed)))  # one write per group, not per block
        for z in packed:
            offsets.append(offsets[-1] + len(z))
        crcs.extend(sums)
    bound = np.asarray(crcs, "<u4") ^ np.uint32(chunk_key(file_key, offset))
    tail = np.asarray(offsets, "<u8").tobytes() + bound.astype("<u4").tobytes()
    writer.write(memoryview(tail))
    return rec.ChunkRecord(
        file, codec << rec.CODEC_SHIFT, offset, n, block, len(crcs), offset + offsets[-1],
        [int(x) for x in start], [int(x) for x in stop],
    )  # fmt: skip


codec_of = rec.codec_of
table_end = rec.packed_tables


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
    key: int,
    leaf: str = "",
    chunk: int = 0,
) -> int:
    """Fill `buffers` with bytes [start, stop) of a compressed chunk, decompressing only the
    blocks they touch (verifying each with `verify`, against the stored checksums XOR `key`,
    the chunk's key of format.binding); returns the bytes read from storage.

    A whole chunk is one read (blocks, offsets and checksums lie back to back); a part of one
    reads its offsets, its checksums, then its blocks. Blocks wholly inside the range are
    decompressed straight into the buffers and checksummed there; a large range's groups of
    blocks are decompressed in the codec threads in parallel."""
    if codec not in (ZSTD, ZSTD_SHUFFLE):
        raise SnapshardError(f"{storage.url}/{name}: unknown codec {codec}")
    if stop <= start:
        return 0
    where = f"{storage.url}/{name}"
    nblocks = -(-nbytes // block)
    b0, b1 = start // block, -(-stop // block)
    packed_size = crc_offset - offset  # of all the chunk's blocks
    whole = b0 == 0 and b1 == nblocks
    if whole and 0 <= packed_size <= WINDOW:
        buf = _scratch("packed", packed_size + table_end(nblocks), WINDOW + table_end(256))
        storage.read_into(name, offset, [buf.data])
        read = len(buf)
        packed: np.ndarray | None = buf[:packed_size]
        offs = np.frombuffer(buf, "<u8", nblocks + 1, packed_size)
        crcs = np.frombuffer(buf, "<u4", nblocks, packed_size + 8 * (nblocks + 1))
    else:
        packed = None
        offs = np.empty(b1 - b0 + 1, "<u8")
        crcs = np.empty(b1 - b0, "<u4")
        storage.read_into(name, crc_offset + 8 * b0, [offs.view(np.uint8).data])
        read = offs.nbytes
        if verify:
            at = crc_offset + 8 * (nblocks + 1) + 4 * b0
            storage.read_into(name, at, [crcs.view(np.uint8).data])
            read += crcs.nbytes
    ends = offs.astype(np.int64)
    if ends[0] < 0 or np.any(np.diff(ends) < 0) or offset + int(ends[-1]) > crc_offset:
        raise CorruptCheckpointError(f"{where}: malformed compressed block offsets")
    out = _Output(buffers)
    ol = [int(x) for x in ends.tolist()]
    cl = [int(x) ^ key for x in crcs.tolist()] if verify else None
    # Blocks wholly inside [start, stop) (relative to b0) take the fast path with zstd alone.
    full0, full1 = -(-start // block) - b0, (stop // block if stop < nbytes else nblocks) - b0
    if codec != ZSTD or not hasattr(_backend(), "ZstdDecompressor"):
        full0 = full1 = 0
    # Windows of blocks whose compressed bytes are at most WINDOW (at least one block).
    k = 0
    while k < b1 - b0:
        lo = int(ends[k])
        e = int(np.searchsorted(ends, lo + WINDOW, side="right")) - 1
        e = min(max(e, k + 1), b1 - b0)
        if packed is None:
            window = _scratch("packed", int(ends[e]) - lo, WINDOW)
            storage.read_into(name, offset + lo, [window.data])
            read += len(window)
        else:
            window = packed[lo : int(ends[e])]

        def unpack(g0: int, g1: int, window: np.ndarray = window, lo: int = lo) -> None:
            j = g0
            while j < g1:
                if full0 <= j < full1:
                    j = _unpack_whole(window.data, lo, ol, cl, j, min(g1, full1), b0, out,
                                      nbytes=nbytes, block=block, start=start, where=where,
                                      leaf=leaf, chunk=chunk)  # fmt: skip
                    if j >= min(g1, full1):
                        continue
                _unpack_block(
                    window[ol[j] - lo : ol[j + 1] - lo].data, b0 + j, out,
                    nbytes=nbytes, block=block, codec=codec, itemsize=itemsize, start=start,
                    stop=stop, crc=cl[j] if cl is not None else None, where=where, leaf=leaf,
                    chunk=chunk,
                )  # fmt: skip
                j += 1

        size = min(stop, (b0 + e) * block) - max(start, (b0 + k) * block)
        for _ in _in_parallel(_groups(k, e, block), size, unpack):
            pass
        k = e
    return read


def _unpack_whole(
    window: memoryview,
    lo: int,
    ends: list[int],
    crcs: list[int] | None,
    j: int,
    stop_j: int,
    b0: int,
    out: _Output,
    *,
    nbytes: int,
    block: int,
    start: int,
    where: str,
    leaf: str,
    chunk: int,
) -> int:
    """Codec 1, blocks j.. (of b0..) wholly inside the read and inside one output buffer, in
    a tight loop: decompress, check the size and the checksum, copy into place. Returns the
    first block it left (stop_j, or one that spans two buffers: the caller's)."""
    import zstandard

    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    at = (b0 + j) * block - start
    i = bisect.bisect_right(out.ends, at)
    buf, base, end = out.bufs[i], out.ends[i] - len(out.bufs[i]), out.ends[i]
    while j < stop_j:
        b = b0 + j
        size = min(block, nbytes - b * block)
        if at + size > end:
            break
        z = window[ends[j] - lo : ends[j + 1] - lo]
        try:
            declared = zstandard.frame_content_size(z)  # -1: not in the frame header
            if declared not in (-1, size):
                raise ValueError(f"the frame declares {declared} bytes")
            plain = d.decompress(z, max_output_size=size)
        except Exception as e:  # the backend's own error types
            raise CorruptCheckpointError(
                f"{where}: leaf {leaf!r}, chunk {chunk}: block {b} does not decompress ({e})"
            ) from None
        if len(plain) != size:
            raise CorruptCheckpointError(
                f"{where}: leaf {leaf!r}, chunk {chunk}: block {b} decompresses to "
                f"{len(plain)} bytes, not {size}"
            )
        if crcs is not None:
            actual = crc32c(plain)
            if actual != crcs[j]:
                raise ChecksumMismatchError(
                    file=where, leaf=leaf, chunk=chunk, block=b, expected=crcs[j], actual=actual
                )
        buf[at - base : at - base + size] = plain
        at += size
        j += 1
    return j


def _unpack_block(
    z: memoryview,
    b: int,
    out: _Output,
    *,
    nbytes: int,
    block: int,
    codec: int,
    itemsize: int,
    start: int,
    stop: int,
    crc: int | None,
    where: str,
    leaf: str,
    chunk: int,
) -> None:
    """Decompress block `b` (compressed bytes `z`), check it against `crc`, and put the
    bytes of [start, stop) it holds into `out`."""
    size = min(block, nbytes - b * block)
    a, end = max(start - b * block, 0), min(stop - b * block, size)
    at = b * block + a - start  # where its bytes go in the output
    direct = out.view(at, at + size) if a == 0 and end == size else None
    if direct is not None and codec == ZSTD:
        plain = direct
    else:
        plain = _scratch("block", size, 4 << 20).data
    try:
        got = _decompress_into(z, plain)
    except Exception as e:  # the backend's own error types
        raise CorruptCheckpointError(
            f"{where}: leaf {leaf!r}, chunk {chunk}: block {b} does not decompress ({e})"
        ) from None
    if got != size:
        raise CorruptCheckpointError(
            f"{where}: leaf {leaf!r}, chunk {chunk}: block {b} decompresses to "
            f"{'more than ' if got > size else ''}{min(got, size)} bytes, not {size}"
        )
    if codec == ZSTD_SHUFFLE:
        src = np.frombuffer(plain, np.uint8)
        if direct is not None:
            np.copyto(np.frombuffer(direct, np.uint8).reshape(-1, itemsize).T,
                      src.reshape(itemsize, -1))  # fmt: skip
            plain = direct
        else:
            plain = unshuffle(src, itemsize).data
    if crc is not None:
        actual = crc32c(plain)
        if actual != crc:
            raise ChecksumMismatchError(
                file=where, leaf=leaf, chunk=chunk, block=b, expected=crc, actual=actual
            )
    if plain is not direct:
        out.put(at, plain[a:end])
