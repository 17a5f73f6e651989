"""One batch's reads: the plan made, the read threads chosen, each read done its way.

`read_batch` plans the reads of a batch's host buffers (plan.py), probes where their bytes
are (prefetch.py: the page cache or the device, which sets the read threads and starts the
prefetch), then runs the reads on the threads, each by the strategy its pieces, the storage
and the chunk's encoding call for (ranges.py, windows.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ..errors import SnapshardError
from ..format import ChunkTable, FileEntry
from ..options import ReadOptions
from ..storage import Storage
from .buffers import Dest, ReadStats
from .plan import ChunkRun, ReadTask, ReadUnit, jobs, plan_reads, verified
from .prefetch import Prefetch, probe_cached
from .ranges import (
    copy_from_scratch,
    piece_bytes,
    read_chunk_run,
    read_compressed,
    read_verified,
    release_scratch,
    scatter_views,
    scratch_buffer,
)
from .windows import read_windowed, row_windows, window_bytes

# A read with more pieces than this goes through one contiguous scratch buffer and strided
# copies, rather than an iovec per piece (Python cost per piece beats the extra memcpy).
_MAX_SCATTER_PIECES = 64


def _run_task(storage: Storage, task: ReadTask, dests: list[Dest], verify: bool) -> None:
    """One read of the plan, the way its pieces, the storage and the chunk's encoding call
    for: windowed, through scratch, or scattered straight into the destinations."""
    runs, r = task.runs, task.rng
    t, c = runs.table, runs.chunk
    checked = verified(verify, t, c)
    compressed = t.flags is not None and bool(t.flags[c])  # blocks of format/encoding.py
    scratch = None
    piece = None
    if r.p1 - r.p0 > _MAX_SCATTER_PIECES:
        piece = None if compressed else piece_bytes(storage, task)
        grids = None if piece is None else row_windows(task)
        if grids is not None and piece is not None:
            window = window_bytes(grids, piece, int(t.block[c]))
            if window is not None:
                read_windowed(storage, task, grids, dests, window, checked)
                return
        scratch = scratch_buffer(r.stop - r.start)
        bufs = [scratch.data]
    else:
        bufs = scatter_views(task, dests)
        if checked and not compressed:
            piece = piece_bytes(storage, task)
    if compressed:
        read_compressed(storage, task, bufs, checked)
    elif not checked:
        storage.read_into(runs.file, runs.file_offset + r.start, bufs)
    else:
        read_verified(storage, task, bufs, piece)
    if scratch is not None:
        copy_from_scratch(task, scratch, dests)


def _name_leaves(error: SnapshardError, unit: ReadUnit, dests: list[Dest]) -> None:
    """Say in the message of a failed read's error which leaves it was for, where it names
    none: a truncated file or a failed read of the storage knows only the file. The error
    keeps its type and fields (only its message grows)."""
    if isinstance(unit, ChunkRun):
        names = list(dict.fromkeys(dests[int(i)].leaf.name for i in unit.dest))
    else:
        names = [unit.runs.leaf.name]
    message = error.args[0] if len(error.args) == 1 else None
    if not isinstance(message, str) or any(repr(n) in message for n in names):
        return
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    error.args = (f"{message} (reading leaf {shown})",)


def read_batch(
    storage: Storage,
    files: Sequence[FileEntry],
    tables: dict[int, ChunkTable],
    dests: list[Dest],
    options: ReadOptions,
    stats: ReadStats,
) -> None:
    """Fill `dests` from the chunks of `tables` (by leaf id; `files`: the file list the
    tables number), as `options` says: verified or not, on how many threads, coalescing
    within which gap (None: the storage's)."""
    verify, threads = options.verify, options.threads
    gap = storage.read_gap_bytes if options.max_gap is None else options.max_gap
    units = plan_reads(files, dests, tables, verify, gap, stats, storage.url)
    # Largest reads first keeps the threads busy to the end.
    units.sort(key=lambda u: -u.size)
    cached = probe_cached(storage, units)
    if threads is None:
        threads = storage.cached_read_threads() if cached is True else storage.read_threads
    ahead = Prefetch(storage, units) if cached is False else None

    def run(job: list[ReadUnit]) -> None:
        for u in job:
            if ahead is not None:
                ahead.started()
            try:
                if isinstance(u, ChunkRun):
                    read_chunk_run(storage, u, dests)
                else:
                    _run_task(storage, u, dests, verify)
            except SnapshardError as e:
                _name_leaves(e, u, dests)
                raise

    try:
        if threads > 1 and len(units) > 1:
            grouped = jobs(units, threads)
            with ThreadPoolExecutor(
                min(threads, len(grouped)), thread_name_prefix="snapshard-read"
            ) as pool:
                for f in [pool.submit(run, job) for job in grouped]:
                    f.result()
        else:
            try:
                run(units)
            finally:  # the pool's threads end with the pool; this one lives on
                release_scratch()
    finally:
        if ahead is not None:
            ahead.stop()
