"""The reads of one range of a chunk, each way a range can land in its destinations.

A range with few pieces is one vectored read straight into the destination buffers
(`scatter_views`, scratch only for the gaps); one with many is read into a thread's scratch
buffer and copied out with strided copies (`copy_from_scratch`). Verified ranges are checked
block by block as they land (`RangeReads`, `read_verified`), in cache-sized pieces where the
storage reads cheaply in pieces (`piece_bytes`). Compressed ranges decompress only the blocks
they touch (`read_compressed`); runs of whole one-block chunks are one request
(`read_chunk_run`). Windowed reads are in windows.py; the choice between them in reads.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..checksum import BlockVerifier, crc32c
from ..dtypes import dtype_from_name
from ..errors import ChecksumMismatchError
from ..storage import Storage
from .buffers import Dest
from .plan import ChunkRun, ReadTask


def scatter_views(task: ReadTask, dests: list[Dest]) -> list[memoryview]:
    """The range as iovecs: destination pieces, with scratch for the bytes between them."""
    r = task.rng
    bufs: list[memoryview] = []
    gaps: list[tuple[int, int]] = []  # (position in bufs, size)
    pos = r.start
    for di, s, off, n in _pieces_of(task):
        if s > pos:
            gaps.append((len(bufs), s - pos))
            bufs.append(memoryview(b""))
        bufs.append(dests[di].buf.data[off : off + n])
        pos = s + n
    if pos < r.stop:
        gaps.append((len(bufs), r.stop - pos))
        bufs.append(memoryview(b""))
    if gaps:
        scratch = np.empty(sum(n for _, n in gaps), dtype=np.uint8).data
        at = 0
        for i, n in gaps:
            bufs[i] = scratch[at : at + n]
            at += n
    return bufs


def _pieces_of(task: ReadTask) -> Iterable[tuple[int, int, int, int]]:
    """(dest index, offset in the chunk, offset in the dest, length) of each run of a range,
    in chunk order. The one run of a chunk's only overlap (a box restored onto the saved
    layout) needs no per-run arrays: building them would cost more than its read."""
    runs, r = task.runs, task.rng
    if len(runs.grids) == 1 and runs.grids[0][1].count == 1:
        di, g = runs.grids[0]
        return [(di, g.src_base, g.dst_base, g.run_bytes)]
    src, length, dest, dst, _ = runs.sorted
    return ((int(dest[p]), int(src[p]), int(dst[p]), int(length[p])) for p in range(r.p0, r.p1))


def copy_from_scratch(task: ReadTask, scratch: np.ndarray, dests: list[Dest]) -> None:
    """Copy the runs of a range read into `scratch` to their destinations: whole overlaps
    as one strided NumPy copy each, runs of overlaps split across ranges one by one."""
    runs, r = task.runs, task.rng
    total = sum(g.count for _, g in runs.grids)
    if r.p1 - r.p0 == total:  # every overlap of the chunk, whole: no per-run arrays needed
        ids, counts = list(range(len(runs.grids))), [g.count for _, g in runs.grids]
    else:
        inside = runs.sorted.overlap[r.p0 : r.p1]
        unique, n_inside = np.unique(inside, return_counts=True)
        ids, counts = unique.tolist(), n_inside.tolist()
    for ov, n in zip(ids, counts, strict=True):
        di, g = runs.grids[ov]
        dest = dests[di].buf
        if n == g.count:
            src = as_strided(
                scratch[g.src_base - r.start :],
                (*g.outer_shape, g.run_bytes),
                (*g.src_strides, 1),
                writeable=False,
            )
            dst = as_strided(dest[g.dst_base :], (*g.outer_shape, g.run_bytes), (*g.dst_strides, 1))
            np.copyto(dst, src)
            continue
        for p in np.flatnonzero(runs.sorted.overlap[r.p0 : r.p1] == ov) + r.p0:
            a, b, ln = (
                int(runs.sorted.src[p]) - r.start,
                int(runs.sorted.dst[p]),
                int(runs.sorted.length[p]),
            )
            dest[b : b + ln] = scratch[a : a + ln]


def _pieces(bufs: list[memoryview], size: int) -> list[list[memoryview]]:
    """`bufs` cut into consecutive groups of `size` bytes (the last one shorter)."""
    out: list[list[memoryview]] = []
    cur: list[memoryview] = []
    n = 0
    for b in bufs:
        while len(b):
            take = min(len(b), size - n)
            cur.append(b[:take])
            b = b[take:]
            n += take
            if n == size:
                out.append(cur)
                cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def piece_bytes(storage: Storage, task: ReadTask) -> int | None:
    """The size of the pieces a range is read in, one at a time (None: one read).

    Where the storage reads cheaply in pieces (local files), a range is read a few checksum
    blocks at a time, each piece handled right after it lands, while it is still in cache:
    one pass over memory instead of two. Bytes that must come from the device are read in
    larger pieces (`Storage.cold_read_piece_bytes`), which the device streams faster."""
    runs, r = task.runs, task.rng
    piece = storage.read_piece_bytes
    if piece is None or r.stop - r.start <= 2 * piece:
        return None
    cold = storage.cold_read_piece_bytes
    # The range's last byte is read last: if even it is cached, the range is.
    if cold is not None and storage.in_memory(runs.file, runs.file_offset + r.stop - 1) is False:
        piece = cold
    block = int(runs.table.block[runs.chunk])
    return max(block, piece // block * block) if block else piece


def _block_span(task: ReadTask) -> tuple[int, int, int]:
    """(checksum block size, first block, one past the last block) of a task's range."""
    block = int(task.runs.table.block[task.runs.chunk])
    return block, task.rng.start // block, -(-task.rng.stop // block)


class RangeReads:
    """The reads of one range of an uncompressed chunk, front to back, each piece checked
    against the chunk's checksum blocks as it lands (with `checked`; `crc_bytes`: the v2
    checksums of the range's blocks, when already read)."""

    def __init__(
        self, storage: Storage, task: ReadTask, checked: bool, crc_bytes: np.ndarray | None = None
    ) -> None:
        self.storage, self.runs = storage, task.runs
        self.at = task.rng.start  # the next byte to read, in the chunk
        self.verifier = self._verifier(task, crc_bytes) if checked else None

    def _verifier(self, task: ReadTask, crc_bytes: np.ndarray | None) -> BlockVerifier:
        t, c, r = self.runs.table, self.runs.chunk, task.rng
        block, b0, b1 = _block_span(task)
        if t.crc_offset is None:  # v1: the checksums are in the index
            crcs = t.block_crcs(c).tolist()
        else:  # v2: the checksums of the blocks read lie in the file
            if crc_bytes is None:
                crc_bytes = np.empty(4 * (b1 - b0), np.uint8)
                at = int(t.crc_offset[c]) + 4 * b0
                self.storage.read_into(self.runs.file, at, [crc_bytes.data])
            key = t.key(c)  # 2.1: the stored checksums are bound to file and offset
            crcs = [0] * b0 + (crc_bytes.view("<u4") ^ np.uint32(key)).tolist()
        return BlockVerifier(crcs, b0, block, r.stop - r.start)

    def read(self, views: list[memoryview]) -> None:
        """Read the next bytes into `views` (and check them)."""
        self.storage.read_into(self.runs.file, self.runs.file_offset + self.at, views)
        self.at += sum(len(x) for x in views)
        self.check(views)

    def check(self, views: list[memoryview]) -> None:
        v = self.verifier
        if v is None:
            return
        for x in views:
            v.update(x)
        if v.mismatch is not None:
            blk, want, got = v.mismatch
            raise ChecksumMismatchError(
                file=f"{self.storage.url}/{self.runs.file}",
                leaf=self.runs.leaf.name,
                chunk=self.runs.chunk,
                block=blk,
                expected=want,
                actual=got,
            )


def read_verified(
    storage: Storage, task: ReadTask, bufs: list[memoryview], piece: int | None
) -> None:
    """Read a range of an uncompressed chunk into `bufs` and check its checksum blocks:
    piece by piece (`piece_bytes`), or in one read, which for a range ending at the end of
    a v2 chunk also brings the checksums that follow it."""
    runs, r = task.runs, task.rng
    t, c = runs.table, runs.chunk
    if piece is not None:
        reads = RangeReads(storage, task, checked=True)
        for views in _pieces(bufs, piece):
            reads.read(views)
        return
    if t.crc_offset is not None:
        crc_at = int(t.crc_offset[c])
        if r.stop == int(t.nbytes[c]) and crc_at == int(t.offset[c]) + r.stop:
            _, b0, b1 = _block_span(task)
            raw, skip = np.empty(4 * (b1 - b0), np.uint8), np.empty(4 * b0, np.uint8)
            storage.read_into(runs.file, runs.file_offset + r.start, [*bufs, skip.data, raw.data])
            RangeReads(storage, task, True, raw).check(bufs)
            return
    RangeReads(storage, task, checked=True).read(bufs)


_scratch = threading.local()
_SCRATCH_REUSE_BYTES = 64 << 20


def scratch_buffer(nbytes: int) -> np.ndarray:
    """A read thread's scratch buffer of `nbytes`, reused from task to task within one read
    (fresh memory costs a page fault per page; on a VM, much more) up to
    _SCRATCH_REUSE_BYTES."""
    if nbytes > _SCRATCH_REUSE_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    buf: np.ndarray | None = getattr(_scratch, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _scratch.buf = np.empty(nbytes, dtype=np.uint8)
    return buf[:nbytes]


def scratch_reused(nbytes: int) -> bool:
    """Whether a scratch buffer of `nbytes` is kept from task to task (`scratch_buffer`)."""
    return nbytes <= _SCRATCH_REUSE_BYTES


def release_scratch() -> None:
    """Drop this thread's scratch buffer (a read thread's ends with its pool; the calling
    thread lives on)."""
    _scratch.__dict__.pop("buf", None)


def read_compressed(storage: Storage, task: ReadTask, bufs: list[memoryview], verify: bool) -> None:
    """Read a range of a compressed chunk (blocks of format/encoding.py) into `bufs`,
    decompressing only the blocks it touches."""
    from ..format.compressed_reads import PackedChunk, read_packed
    from ..format.records import codec_of

    runs, r = task.runs, task.rng
    t, c = runs.table, runs.chunk
    assert t.flags is not None and t.crc_offset is not None
    packed = PackedChunk(
        runs.file, offset=int(t.offset[c]), nbytes=int(t.nbytes[c]), block=int(t.block[c]),
        crc_offset=int(t.crc_offset[c]), codec=codec_of(int(t.flags[c])),
        itemsize=dtype_from_name(runs.leaf.dtype).itemsize, key=t.key(c), leaf=runs.leaf.name,
        chunk=c,
    )  # fmt: skip
    read_packed(storage, packed, r.start, r.stop, bufs, verify=verify)


def read_chunk_run(storage: Storage, run: ChunkRun, dests: list[Dest]) -> None:
    """One request for a ChunkRun's chunks and checksums, straight into the destinations,
    then each chunk checked against its checksum as `RangeReads` would."""
    n = len(run.dest)
    crc_bytes = np.empty(4 * n, np.uint8)
    crc_view = crc_bytes.data
    bufs: list[memoryview] = []
    for i, di in enumerate(run.dest.tolist()):
        bufs.append(dests[di].buf.data)  # (the chunk is the whole destination)
        bufs.append(crc_view[4 * i : 4 * i + 4])
    storage.read_into(run.file, run.file_start, bufs)
    if not run.verify:
        return
    expected = (crc_bytes.view("<u4") ^ run.keys).tolist()
    for i, want in enumerate(expected):
        actual = crc32c(bufs[2 * i])
        if actual != want:
            raise ChecksumMismatchError(
                file=f"{storage.url}/{run.file}", leaf=dests[int(run.dest[i])].leaf.name,
                chunk=int(run.chunk[i]), block=0, expected=want, actual=actual,
            )  # fmt: skip
