"""The writer process's reads of the staged bytes it writes: out of the training process's
memory (`RemoteBytes`, process_vm_readv), or through the shared window (`Window`,
`WindowBytes`), and of the items staged only as they are written (`StagedLater`). The
protocol is writer_protocol.py's; the training process's side of these reads is
writer_exposure.py.

The staged bytes are read straight from the training process, item by item as each file is
written: nothing is copied in the blocking phase and nothing is shared but the addresses,
which stay valid because the training process keeps the save's items until the save ends.
Through a window they are copied once more, by the training process, a window's worth per
call: a run of small items in one call (`read_together`), a large item in window-sized
pieces.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from typing import Any

import numpy as np

from ..errors import SnapshardError
from .writer_protocol import Link

IOVEC = np.dtype([("base", np.uint64), ("len", np.uint64)])
IOV_MAX = 1024  # iovecs per call (Linux's IOV_MAX)


@functools.cache
def _process_vm_readv() -> Any:
    """libc's process_vm_readv, typed (looked up when first used: Linux has it, and only
    a writer process, which runs on Linux alone, calls it)."""
    call = ctypes.CDLL(None, use_errno=True).process_vm_readv
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                     ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
    call.restype = ctypes.c_ssize_t
    return call


def _readv(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    """process_vm_readv of iovec arrays (IOVEC); ctypes lets the interpreter go for it."""
    got = int(_process_vm_readv()(pid, local.ctypes.data, len(local), remote.ctypes.data,
                                  len(remote), 0))  # fmt: skip
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"reading the training process's memory: {os.strerror(err)}")
    return got


def read_remote(pid: int, address: int, out: np.ndarray) -> None:
    """Fill `out` with the bytes at `address` in process `pid` (`process_vm_readv`, which
    copies without the interpreter)."""
    n, done = out.nbytes, 0
    local, remote = np.empty(1, IOVEC), np.empty(1, IOVEC)
    while done < n:
        local[0] = (out.ctypes.data + done, n - done)
        remote[0] = (address + done, n - done)
        got = _readv(pid, local, remote)
        if got == 0:
            raise OSError(0, "reading the training process's memory: nothing read")
        done += got


def read_words(pid: int, addresses: np.ndarray) -> np.ndarray:
    """The 8-byte words at `addresses` in process `pid`, read in a few calls."""
    out = np.empty(len(addresses), np.uint64)
    for a in range(0, len(addresses), IOV_MAX):
        b = min(a + IOV_MAX, len(addresses))
        local, remote = np.empty(b - a, IOVEC), np.empty(b - a, IOVEC)
        local["base"] = out.ctypes.data + 8 * np.arange(a, b, dtype=np.uint64)
        remote["base"] = addresses[a:b]
        local["len"] = remote["len"] = 8
        if _readv(pid, local, remote) != 8 * (b - a):
            raise OSError(0, "reading the training process's memory: a word was not read")
    return out


class RemoteBytes:
    """A staged item's bytes in the training process, read when the item is written
    (StagedItem.materialize calls np.asarray on it), or with the run of items it is
    written in (`read_together`)."""

    __slots__ = ("address", "dtype", "got", "nbytes", "pid", "shape")

    def __init__(self, pid: int, address: int, dtype: np.dtype, shape: tuple[int, ...]):
        self.pid, self.address, self.dtype, self.shape = pid, address, dtype, shape
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.got: np.ndarray | None = None

    @staticmethod
    def read_together(parts: list[Any]) -> None:
        """Read these items' bytes into one buffer per IOV_MAX of them, each at a multiple
        of 64 bytes, with one process_vm_readv. One call per item cost ~35 us for an item
        of 16 KB: most of a save of 10,000 such arrays in the writer (0.6 s of its CPU),
        and what the writer's CPU takes, a training loop on the next core loses. What a
        call leaves unread is read item by item, which names the failure."""
        todo = [p for p in parts if type(p) is RemoteBytes and p.got is None]
        for a in range(0, len(todo), IOV_MAX):
            batch = todo[a : a + IOV_MAX]
            sizes = np.fromiter((p.nbytes for p in batch), np.int64, len(batch))
            starts = np.zeros(len(batch) + 1, np.int64)
            np.cumsum((sizes + 63) // 64 * 64, out=starts[1:])
            buf = np.empty(int(starts[-1]), np.uint8)
            local, remote = np.empty(len(batch), IOVEC), np.empty(len(batch), IOVEC)
            local["base"] = buf.ctypes.data + starts[:-1]
            remote["base"] = np.fromiter((p.address for p in batch), np.uint64, len(batch))
            local["len"] = remote["len"] = sizes
            try:
                got = _readv(batch[0].pid, local, remote)
            except OSError:
                got = 0
            ends = np.cumsum(sizes).tolist()
            for p, at, end in zip(batch, starts.tolist(), ends, strict=False):
                if end > got:
                    break
                p.got = buf[at : at + p.nbytes].view(p.dtype).reshape(p.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.got is not None:
            out, self.got = self.got, None
            return out
        out = np.empty(self.shape, self.dtype)
        try:
            read_remote(self.pid, self.address, out)
        except OSError as e:
            raise SnapshardError(f"the writer process could not read a staged item: {e}") from e
        return out


class Window:
    """Staged bytes read through a window of shared memory, copied into it by the training
    process on request: where the writer cannot read the training process's memory
    (process_vm_readv missing, as in some sandboxes, or forbidden). One request at a time
    (the files are written by several threads), as many items per request as the window
    holds."""

    def __init__(self, link: Link, view: np.ndarray):
        self._link = link
        self._view = view
        self._lock = threading.Lock()

    def read(self, parts: list[tuple[int, np.ndarray]]) -> None:
        """Fill each (item, out) pair's `out` (C-contiguous) with the item's bytes."""
        size = len(self._view)
        with self._lock:
            rows: list[tuple[int, int, int, int]] = []
            pieces: list[tuple[np.ndarray, int]] = []
            used = 0
            for j, out in parts:
                flat = out.reshape(-1).view(np.uint8)
                for a in range(0, len(flat), size):
                    piece = flat[a : a + size]
                    if used + len(piece) > size:
                        self._fetch(rows, pieces)
                        rows, pieces, used = [], [], 0
                    rows.append((j, a, len(piece), used))
                    pieces.append((piece, used))
                    used += len(piece)
            self._fetch(rows, pieces)

    def _fetch(
        self, rows: list[tuple[int, int, int, int]], pieces: list[tuple[np.ndarray, int]]
    ) -> None:
        if not rows:
            return
        try:
            self._link.call("copy", np.array(rows, np.int64))
        except Exception as e:
            raise SnapshardError(f"the writer process could not read a staged item: {e}") from e
        for piece, at in pieces:
            piece[:] = self._view[at : at + len(piece)]


class WindowBytes:
    """A staged item's bytes in the training process, read through its `Window` when the
    item is written, or with the run of items it is written in (`read_together`)."""

    __slots__ = ("dtype", "got", "item", "later", "shape", "window")
    # A file's small items are read this many bytes ahead of their writing, not a run
    # (4 MiB) at a time: each request wakes a thread of the training process three times
    # (its recv, its copy, its reply), each waiting up to a switch interval (5 ms) for the
    # interpreter. 10,000 arrays of 16 KB on a gVisor host: 40 requests, a background phase
    # of 1.28 s; 10 requests, 0.80 s. Not items the host budget left for later (`later`):
    # the training process holds a request's worth of their host copies at once.
    READ_AHEAD = 16 << 20

    def __init__(
        self, window: Window, item: int, dtype: np.dtype, shape: tuple[int, ...], later: bool
    ):
        self.window, self.item, self.dtype, self.shape = window, item, dtype, shape
        self.later = later  # its host copy is made when the request comes (Exposure.copy)
        self.got: np.ndarray | None = None

    @staticmethod
    def read_together(parts: list[Any]) -> None:
        """Read these items' bytes in as few requests as the window allows."""
        todo = [p for p in parts if isinstance(p, WindowBytes) and p.got is None]
        if not todo:
            return
        outs = [np.empty(p.shape, p.dtype) for p in todo]
        todo[0].window.read([(p.item, out) for p, out in zip(todo, outs, strict=True)])
        for p, out in zip(todo, outs, strict=True):  # (only once every byte is read)
            p.got = out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self.got is None:
            WindowBytes.read_together([self])
        out, self.got = self.got, None
        assert out is not None
        return out


class StagedLater:
    """An item whose host copy the training process makes only when it is written (the
    host budget left it to the background phase, SaveOptions.host_budget), read from its
    memory: `stage` asks for the copy there and its address, the bytes are read as any
    other item's (`bytes`), and `unstage` lets the copy go, so that only the items being
    written hold host memory, as in the threads' background phase. (Through the window the
    training process stages an item when its bytes are first asked for.)"""

    __slots__ = ("bytes", "item", "link")

    def __init__(self, link: Link, item: int, bytes: RemoteBytes):
        self.link, self.item, self.bytes = link, item, bytes

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.bytes.address = self.link.call("stage", self.item)
        try:
            return np.asarray(self.bytes)
        finally:
            self.link.call("unstage", self.item)
