"""zstd and the codec threads: what encoding.py compresses, compressed_reads.py decompresses.

zstd comes from the `zstandard` package (the `compress` extra) or Python's own
`compression.zstd` (3.14+). zstd and crc32c release the GIL, so a large range's groups of
blocks are compressed or decompressed in the codec threads (one per core of the process's
share, `cpus.share`) at once, and the restore's reader threads decompress in parallel.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np

from .. import cpus
from ..errors import SnapshardError

_local = threading.local()
_T = TypeVar("_T")

# Ranges of at least this many (uncompressed) bytes are split into groups of blocks that the
# codec threads compress or decompress in parallel; smaller ones stay in the calling thread.
PARALLEL_MIN = 8 << 20
_GROUP = 2 << 20  # uncompressed bytes per group (at least one block)

_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def backend() -> Any:
    """The zstd module: `zstandard`, else Python's `compression.zstd`."""
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
        backend()
    except SnapshardError:
        return False
    return True


def has_decompressor() -> bool:
    """Whether the backend decompresses into a buffer of ours (`zstandard` does)."""
    return hasattr(backend(), "ZstdDecompressor")


def compress(data: memoryview | bytes, level: int) -> bytes:
    """One zstd frame of `data` (a compressor per thread and level, reused)."""
    z = backend()
    if hasattr(z, "ZstdCompressor"):
        key = ("c", level)
        c = getattr(_local, "c", {}).get(key)
        if c is None:
            _local.c = {**getattr(_local, "c", {}), key: (c := z.ZstdCompressor(level=level))}
        return bytes(c.compress(data))
    return bytes(z.compress(bytes(data), level=level))


def decompressor() -> Any:
    """This thread's `zstandard.ZstdDecompressor` (see has_decompressor)."""
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = backend().ZstdDecompressor()
    return d


def decompress_into(data: memoryview, out: memoryview) -> int:
    """Decompress the zstd frame `data` into `out` (straight into it where the backend can);
    returns how many bytes the frame holds, up to len(out) + 1 (more than fits is an error
    the caller reports)."""
    z = backend()
    if hasattr(z, "ZstdDecompressor"):
        n = 0
        with decompressor().stream_reader(data, read_size=max(1, len(data))) as r:
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


def _threads() -> int:
    return min(cpus.share(), 32)


def _codec_pool() -> ThreadPoolExecutor | None:
    """The process's codec threads (one per core of its share, `cpus.share`; none on one
    core). Made again after a fork."""
    global _pool
    n = _threads()
    if n < 2:
        return None
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(n, thread_name_prefix="snapshard-codec"))
        return _pool[1]


def groups(first: int, stop: int, block: int) -> list[tuple[int, int]]:
    """Blocks [first, stop) in groups of about _GROUP bytes (at least one block each)."""
    per = max(1, _GROUP // max(block, 1))
    return [(g, min(g + per, stop)) for g in range(first, stop, per)]


def in_parallel(
    parts: list[tuple[int, int]], nbytes: int, fn: Callable[[int, int], _T]
) -> Iterator[_T]:
    """fn(g0, g1) of every group, in order: in the codec threads (at most two per thread in
    flight, which bounds what waits to be consumed) when the range is large, else here."""
    pool = _codec_pool() if nbytes >= PARALLEL_MIN and len(parts) > 1 else None
    if pool is None:
        for g0, g1 in parts:
            yield fn(g0, g1)
        return
    ahead = 2 * _threads()
    pending: deque[Future[_T]] = deque()
    todo = iter(parts)
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


def scratch(name: str, n: int, keep: int) -> np.ndarray:
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
