"""The staged bytes a training process lets its writer process read, a save at a time: the
training process's side of the writer's reads (writer_reads.py). Where each item's bytes
are (`addresses_of`) goes in the save's message; `Exposure` answers the reads that need
this process.

Where the writer cannot read this process's memory (a sandbox without process_vm_readv, a
kernel that forbids it), it reads the staged bytes through a window of shared memory
instead (`window_file`), which this process copies them into on the writer's request
(`Exposure.copy`): one copy more, made a window's worth at a time with the interpreter let
go for large items, and a run of small items per request. With a host budget, the
device-to-host copies of the items beyond it are made here when the writer asks for each
(`Exposure.stage`) and let go after (`Exposure.unstage`).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from itertools import pairwise
from typing import Any

import numpy as np

from ..errors import SnapshardError
from .staging import StagedItem
from .state import PreparedSave
from .writer_reads import IOV_MAX, IOVEC

_WINDOW_BYTES = 64 << 20  # the shared window, where the writer reads through one


class Exposure:
    """The bytes of the save in the writer that it may read (`expose`), and the window it
    reads them through where it cannot read this process's memory (`window`; None where it
    can)."""

    def __init__(self, window_fd: int) -> None:
        self.window_fd = window_fd  # the window's file, kept where the writer reads through it
        self.window: np.ndarray | None = None
        self.release()

    def map_window(self) -> None:
        """The writer reads through the window (its probe said so): map it for the copies."""
        self.window = np.frombuffer(mmap.mmap(self.window_fd, 0), np.uint8)

    def release(self) -> None:
        """Nothing is exposed: the save's items are let go (between saves)."""
        self.expose([], [], np.zeros(0, np.int64))

    def close(self) -> None:
        if self.window_fd >= 0:
            os.close(self.window_fd)
            self.window_fd = -1

    def expose(
        self,
        items: list[StagedItem],
        hosts: list[np.ndarray | None],
        addresses: np.ndarray,
        later: np.ndarray | None = None,
    ) -> None:
        """The bytes the writer may read: those of `items`, `hosts` (kept alive until the
        save ends; None, as marked in `later`: an item staged later, `stage`) at
        `addresses`. Their sizes are what a window's reads are checked against; the writer
        reads the others directly."""
        self._items, self._hosts, self._addresses = items, hosts, addresses.copy()
        self._later = set() if later is None else set(np.flatnonzero(later).tolist())
        if self.window is not None:
            self._sizes = np.fromiter(
                (0 if h is None else h.nbytes for h in hosts), np.int64, len(hosts)
            )
        else:
            self._sizes = np.zeros(len(hosts), np.int64)
        self._left: dict[int, int] = {}  # staged items' bytes not yet copied to the window

    def stage(self, j: int) -> int:
        """Make item j's host copy, which the host budget left to the background phase (the
        device-to-host copy, made here as the threads would make it just before the write);
        the address of its bytes, held until `unstage(j)`."""
        if j not in self._later:
            raise SnapshardError(
                f"the writer process asked to stage item {j}, not one staged later"
            )
        host = np.ascontiguousarray(self._items[j].materialize())
        self._hosts[j] = host
        self._sizes[j] = host.nbytes
        self._addresses[j] = host.__array_interface__["data"][0]
        return int(self._addresses[j])

    def unstage(self, j: int) -> None:
        """Drop item j's host copy (`stage`): the budget holds only those being written."""
        if j in self._later:
            self._left.pop(j, None)
            self._hosts[j] = None
            self._sizes[j] = 0

    def copy(self, rows: np.ndarray) -> None:
        """Copy the bytes the writer asked for into the window: rows of (item, byte
        offset, nbytes, window offset), checked as columns against the items and the
        window; each run of rows back to back in the window goes in with one pwritev(2)
        per IOV_MAX rows. (Row by row in Python, building a view of each piece, this held
        the interpreter 30-45 ms per 10,000 arrays of 16 KB; NumPy's copies, which let it
        go for each piece, each waited up to a switch interval to have it back.) An item
        staged later is staged by its first piece asked for and let go once every byte of
        it was copied: no call of its own (a stage and an unstage per item made a save of
        2,000 such arrays on a TPU host 4x slower than in threads)."""
        window = self.window
        if window is None:
            raise SnapshardError("the writer process asked for a copy without a window")
        rows = np.asarray(rows, np.int64).reshape(-1, 4)
        j, a, n, at = rows.T
        if self._later:
            for x in np.unique(j).tolist():
                if x in self._later and self._hosts[x] is None:
                    self.stage(x)
                    self._left[x] = int(self._sizes[x])
        ok = (j >= 0) & (j < len(self._sizes)) & (a >= 0) & (n >= 0) & (at >= 0)
        ok &= at + n <= len(window)
        ok[ok] &= a[ok] + n[ok] <= self._sizes[j[ok]]
        if not ok.all():
            bad = tuple(rows[int(np.argmin(ok))].tolist())
            raise SnapshardError(f"the writer process asked for bytes out of range: {bad}")
        src = self._addresses[j] + a
        runs = np.flatnonzero(at[1:] != at[:-1] + n[:-1]) + 1
        for p, q in pairwise([0, *runs.tolist(), len(rows)]):
            for b in range(p, q, IOV_MAX):
                e = min(b + IOV_MAX, q)
                self._write_window(src[b:e], n[b:e], int(at[b]))
        if self._left:
            for x, k in zip(j.tolist(), n.tolist(), strict=True):
                if x in self._left:
                    self._left[x] -= k
                    if self._left[x] <= 0:
                        self.unstage(x)

    def _write_window(self, src: np.ndarray, n: np.ndarray, at: int) -> None:
        """The bytes at addresses `src`, `n` of each, back to back into the window from
        `at`: one pwritev(2) into its file, the interpreter let go for the copy; memmove'd
        through the mapping where the file refuses it."""
        iov = np.empty(len(src), IOVEC)
        iov["base"], iov["len"] = src, n
        done = _pwritev(self.window_fd, iov.ctypes.data, len(iov), at)
        if done != int(n.sum()):
            to = self.window.ctypes.data + at + np.cumsum(n) - n  # type: ignore[union-attr]
            for d, s, k in zip(to.tolist(), src.tolist(), n.tolist(), strict=True):
                ctypes.memmove(d, s, k)


def _pwritev(fd: int, iov: int, count: int, offset: int) -> int:
    """libc's pwritev(2) of `count` iovecs at address `iov` (ctypes lets the interpreter
    go for it); -1 where it fails or libc lacks it."""
    call = _libc_pwritev()
    return -1 if call is None else int(call(fd, iov, count, offset))


@functools.cache
def _libc_pwritev() -> Any:
    try:
        call = ctypes.CDLL(None, use_errno=True).pwritev
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong]
    call.restype = ctypes.c_ssize_t
    return call


def _data_offset() -> int | None:
    """Where an ndarray object holds the address of its bytes (NumPy's PyArrayObject.data,
    after the object's header), found in two probes' own bytes rather than assumed; None
    where it is not found alike in both."""
    found = []
    for probe in (np.zeros(3, np.uint8), np.ones((2, 5), np.float64)):
        address = probe.__array_interface__["data"][0]
        head = ctypes.string_at(id(probe), 64)
        found.append(
            [k for k in range(0, 57, 8) if int.from_bytes(head[k : k + 8], "little") == address]
        )
    return found[0][0] if len(found[0]) == 1 and found[0] == found[1] else None


_DATA_OFFSET = _data_offset()


def addresses_of(
    prep: PreparedSave, *, direct: bool
) -> tuple[np.ndarray, list[np.ndarray | None], int | None]:
    """Where each staged item's bytes are: for a writer reading this process's memory
    (`direct`), its ndarray object's address (id) where _DATA_OFFSET is known (0.05 us an
    item, where asking each array for its address costs microseconds), else the bytes'
    address, which a window's copies read from; each item's bytes C-contiguous (a copy of
    an item that was not, to be kept until the save ends), None for an item whose copy the
    host budget left to the background phase (address 0); and the message's data_offset,
    where `where` holds the objects' addresses."""
    hosts: list[np.ndarray | None] = []
    for it in prep.items:
        host = it.host
        if host is not None and not host.flags.c_contiguous:
            host = np.ascontiguousarray(host)
        hosts.append(host)
    present = [h for h in hosts if h is not None]
    if direct and _DATA_OFFSET is not None:
        where = np.fromiter(map(id, present), np.int64, len(present))
    elif _DATA_OFFSET is not None:  # the word in each object (0.6 us; asking each array: 3 us)
        words = (ctypes.c_void_p.from_address(id(h) + _DATA_OFFSET).value for h in present)
        where = np.fromiter((w or 0 for w in words), np.int64, len(present))
    else:
        addresses = (h.__array_interface__["data"][0] for h in present)
        where = np.fromiter(addresses, np.int64, len(present))
    if len(present) < len(hosts):  # items staged later (`Exposure.stage`): 0
        full = np.zeros(len(hosts), np.int64)
        full[[i for i, h in enumerate(hosts) if h is not None]] = where
        where = full
    return where, hosts, _DATA_OFFSET if direct else None


def window_file() -> int:
    """A shared memory file of _WINDOW_BYTES for the writer to read through (its pages
    are taken only where it is used), or -1 where this system makes none."""
    try:
        fd = os.memfd_create("snapshard-window")
    except (AttributeError, OSError):
        return -1
    try:
        os.ftruncate(fd, _WINDOW_BYTES)
    except OSError:
        os.close(fd)
        return -1
    return fd
