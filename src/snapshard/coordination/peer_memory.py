"""Memory that every process of a job can read, when they all run on one host: one shared
segment per process, which it alone writes and every other process maps read-only.

A restore that exchanges what it read (torch bands, torch/exchange.py) uses it instead of a
collective when it can: a reader puts its bytes in its segment, the job agrees through the
key-value store that every segment is written, and each process copies its pieces straight
out of the others' segments. The bytes cross memory once, where a loopback socket copies
them through the kernel twice.

Call order, on every process, with the same sizes (a collective):

1. `PeerMemory.open(rv, sizes)`: process 0 draws a random name and publishes it; each
   process makes its segment in /dev/shm and reserves its pages (`posix_fallocate`, so
   a full tmpfs is an error here, never a SIGBUS later); they agree that every process
   made one; each maps every other's; they agree that every process mapped them all; each
   removes its segment's name. Returns None on every process when any step failed on any
   process (other hosts, another /dev/shm, no room): the caller then uses its collective.
   A process killed between making its segment and that last agreement (milliseconds)
   leaves a `snapshard-*` file in /dev/shm; after it, nothing is left to clean up.
   With `keep`, the segments stay mapped after `close` for the next `keep` open: it
   first asks whether every process still holds the same segments, as the same process,
   each at least as large as asked (one agreement), and if so returns them without making
   anything; else it makes new ones, which replace the kept ones. Fresh shared memory
   costs a page fault per page, and on a VM much more (40 MiB took 0.07-0.29 s to make
   here), which a job that restores again and again would pay on every restore. A
   process then holds its last kept segment (at most what one exchange asked for) and
   maps its peers' until `release_kept()`, or its end; nothing is left in /dev/shm.
2. `mine()` to write this process's segment, `of(p)` to read process p's, as NumPy views.
   When a process may write its segment again after others have read it is the caller's
   protocol (torch/exchange.py uses two slots: see there). Between two opens there is
   nothing to protect: a process reports at the next open only once its last exchange
   is over, and the open returns on none before every process reported.
3. `close()`: drops the mappings (kept ones stay for the next open).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
from collections.abc import Sequence

import numpy as np

from .rendezvous import Rendezvous, on_every_process, same_on_every_process

log = logging.getLogger("snapshard")

SHM_DIR = "/dev/shm"
# Map every page at once: faulting in each page of a shared mapping on first touch costs
# several times more (measured: a 4-rank band exchange took 0.48 s instead of 0.30 s).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
PREFIX = "snapshard-"
# The segments a `keep` open made, by (coordinator, process): see the module docstring.
_kept: dict[tuple[int, int], PeerMemory] = {}
# False: `open` returns None without trying (the callers use their collectives), e.g. to
# compare the two ways. The same on every process.
ENABLED = True


def _path(name: str, process: int) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{name}-{process}")


class PeerMemory:
    """The mapped segments of one exchange's processes (see the module docstring)."""

    def __init__(self, maps: list[mmap.mmap], rank: int, name: str, kept: bool) -> None:
        self._maps, self.rank, self.name, self.kept = maps, rank, name, kept

    @classmethod
    def open(cls, rv: Rendezvous, sizes: Sequence[int], keep: bool = False) -> PeerMemory | None:
        """Step 1: every process's segment (sizes[p] bytes for process p) mapped on every
        process, or None on every process; with `keep`, the kept ones where they serve."""
        coord = rv.coord
        me, world = coord.process_index, coord.process_count
        if world < 2 or not ENABLED:
            return None
        key = (id(coord), me)
        if keep:
            old = _kept.get(key)
            fits = old is not None and old._holds(me, sizes)
            if same_on_every_process(rv.sub("kept"), old.name if old and fits else None):
                return old
            if old is not None:
                old.release()
        made = cls._make_all(rv, sizes, keep)
        if made is not None and keep:
            _kept[key] = made
        return made

    def _holds(self, rank: int, sizes: Sequence[int]) -> bool:
        return (
            self.rank == rank
            and len(self._maps) == len(sizes)
            and all(len(m) >= n for m, n in zip(self._maps, sizes, strict=True))
        )

    @classmethod
    def _make_all(cls, rv: Rendezvous, sizes: Sequence[int], keep: bool) -> PeerMemory | None:
        coord = rv.coord
        me, world = coord.process_index, coord.process_count
        rv.start_clock()
        if me == 0:
            rv.report("name", name=secrets.token_hex(8))
        name = str(rv.wait("name", "process 0")["name"])
        own: mmap.mmap | None = None
        try:
            own = _make(_path(name, me), max(1, sizes[me]))
        except OSError as e:
            log.debug("no shared segment for process %d: %s", me, e)
        maps: list[mmap.mmap | None] = [None] * world
        try:
            made = on_every_process(rv.sub("made"), own is not None)
            if me == 0:  # every process has read the name by now
                with contextlib.suppress(Exception):
                    coord.delete(f"{rv.prefix}/name")
            if not made:
                return None
            maps[me] = own
            try:
                for p in range(world):
                    if p != me:
                        maps[p] = _map(_path(name, p), max(1, sizes[p]))
                mapped = True
            except OSError as e:
                log.debug("process %d cannot map its peers' segments: %s", me, e)
                mapped = False
            if not on_every_process(rv.sub("mapped"), mapped):
                return None
            done = [m for m in maps if m is not None]
            maps = [None] * world  # kept by the object now, not closed below
            return cls(done, me, name, keep)
        finally:
            if own is not None:
                with contextlib.suppress(OSError):
                    os.unlink(_path(name, me))
            for m in maps:
                if m is not None:
                    m.close()

    def mine(self) -> np.ndarray:
        """This process's segment, writable."""
        return np.frombuffer(self._maps[self.rank], np.uint8)

    def of(self, process: int) -> np.ndarray:
        """Process `process`'s segment (this process's own too), to read."""
        a = np.frombuffer(self._maps[process], np.uint8)
        if process != self.rank:
            a.flags.writeable = False
        return a

    def close(self) -> None:
        """Step 3. Views from `mine`/`of` must be gone by now."""
        if not self.kept:
            self._unmap()

    def release(self) -> None:
        """Drop the mappings now, kept or not."""
        for key, kept in list(_kept.items()):
            if kept is self:
                del _kept[key]
        self._unmap()

    def _unmap(self) -> None:
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view still alive keeps its mapping
                m.close()
        self._maps = []


def release_kept() -> None:
    """Drop every kept segment of this process (its peers drop theirs at their next open)."""
    while _kept:
        _kept.popitem()[1].release()


def _make(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def _map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, not {nbytes}")
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
