"""Where a restore's bytes are, and asking the storage for them ahead of the reads.

`probe_cached` tells from the largest reads whether the bytes are in memory (the page cache)
or must come from the device; reads.py sets the read threads by it and, for the device,
runs a `Prefetch` beside the reads.
"""

from __future__ import annotations

import threading

import numpy as np

from ..errors import SnapshardError
from ..storage import Storage
from .plan import ReadUnit

# The largest reads of a restore probed for whether its bytes are in memory (`probe_cached`).
_PROBED_READS = 8
# How far a restore from the device asks for bytes ahead of its reads (`Prefetch`).
# Evicted 2 GiB restores, 4 threads, fresh processes: 1.30 s at 64 MiB, 1.28-1.31 s at 16-32
# MiB, 1.35-1.45 s at 128-256 MiB, 1.85 s at 512 MiB, 1.85-2.05 s without (medians of 6).
_PREFETCH_BYTES = 64 << 20


def probe_cached(storage: Storage, tasks: list[ReadUnit]) -> bool | None:
    """Whether the bytes of a restore's largest reads are in memory (each range's last byte
    is read last: if even it is cached, the range is); None where the storage cannot tell
    or there are too few reads for it to matter, or a file cannot be opened (the read of it
    says so then, naming the leaves it was for)."""
    if len(tasks) <= 1 or storage.cold_read_piece_bytes is None:
        return None
    probe = tasks[:_PROBED_READS]
    try:
        last = [storage.in_memory(t.file, t.file_start + t.size - 1) for t in probe]
    except SnapshardError:
        return None
    if any(x is None for x in last):
        return None
    return all(last)


class Prefetch:
    """Asks the storage to fetch the ranges of a restore whose bytes are on the device ahead
    of the read threads (`Storage.will_need`), in the order the threads take them, at most
    _PREFETCH_BYTES beyond the bytes of the reads started: the device always has work
    queued, also while the threads check and copy what they read. Call `started` as each
    read starts (in task order) and `stop` at the end."""

    def __init__(self, storage: Storage, tasks: list[ReadUnit]) -> None:
        self.storage, self.tasks = storage, tasks
        self.cond = threading.Condition()
        self.begun = 0  # reads started
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="snapshard-prefetch")
        self.thread.start()

    def started(self) -> None:
        with self.cond:
            self.begun += 1
            self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join()

    def _run(self) -> None:
        sizes = [t.size for t in self.tasks]
        starts = np.cumsum([0, *sizes]).tolist()  # bytes of the reads before each
        for i, t in enumerate(self.tasks):
            with self.cond:
                while not self.stopped and starts[i] - starts[self.begun] > _PREFETCH_BYTES:
                    self.cond.wait()
                if self.stopped:
                    return
                if i < self.begun:  # its read has started: the read fetches it
                    continue
            if not t.hintable:
                continue  # compressed: the range is not a file range
            try:
                self.storage.will_need(t.file, t.file_start, sizes[i])
            except Exception:  # a hint: the reads report what is wrong
                return
