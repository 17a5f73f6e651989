"""The writer process's side of a background phase run out of the training process
(SaveOptions.background="process"; the training process's side is writer_process.py).

Started once per training process as `python -c "...writer_main import main; main()" FD
WINDOW`, with FD one end of a socket pair and WINDOW a shared memory file (memfd) of the
training process's, or -1. The protocol, in order, each message a pickled tuple:

1. the training process sends ("probe", address, nbytes, expected, window_only); the
   writer reads those bytes out of the training process's memory (its parent's)
   (`process_vm_readv`) and answers ("ready", None); where it cannot (a kernel or a sandbox
   that forbids or lacks the call) or is told not to (`window_only`), it answers
   ("window", why) and reads every staged item through the shared window instead (below),
   or ("unable", why) where there is no window: the training process then keeps its
   background phase in threads;
2. ("template", Template) whenever the tree changed (its leaves, without their values);
   then per save, ("save", Message): where each staged item's bytes are in the training
   process's memory, the values of the leaves that are not arrays, the save's storage and
   rendezvous. The writer runs the whole background phase (saving.commit.finish_here: data
   files, records, process 0's commit);
3. while it runs, each call on the coordinator or the storage's commit guard goes to the
   training process as ("call", method, args) and waits for ("reply", value) or
   ("raise", error): the key-value store of a job is the training process's;
   Through a window, reading staged bytes is such a call too: ("call", "copy", (rows,))
   with rows of (item, byte offset, nbytes, window offset), which the training process
   answers once it has copied those bytes of its items into the window (`Window`); and
   an item the host budget left without a host copy (SaveOptions.host_budget) is asked
   for as it is written: ("call", "stage", (item,)) makes its copy and answers its
   address, then its bytes are read as any other item's, then ("call", "unstage",
   (item,)) lets the copy go (`StagedLater`); through a window, the copy call stages such
   an item itself and lets it go once all its bytes went through;
4. the save ends with ("done", timings, made, warned) or ("failed", error, made, warned),
   the error pickled with its type (errors.py: every snapshard error crosses processes by
   pickle), `made` what the writer's copy of the storage counted of its requests (an
   object store's), which the training process's copy adds to its own, and `warned` the
   warnings the save raised here (category, text), which the training process raises
   again (an incremental save's base that cannot prove its chunks equal says so).

The staged bytes are read straight from the training process, item by item as each file is
written: nothing is copied in the blocking phase and nothing is shared but the addresses,
which stay valid because the training process keeps the save's items until step 4. Through
a window they are copied once more, by the training process, a window's worth per call: a
run of small items in one call (`read_together`), a large item in window-sized pieces. The
writer imports no framework: NumPy, the format and the storage (a local filesystem, or an
object store whose client the writer makes again from its URL and options, once). It ends
when the socket closes (its training process ended or let it go) and is killed with it
otherwise.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import pickle
import signal
import socket
import sys
import threading
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..coordination.base import Coordinator
from ..coordination.rendezvous import Rendezvous
from ..errors import SnapshardError
from ..format import Leaf
from ..incremental import Increment
from ..options import SaveOptions
from ..save_leaves import SaveArray
from ..staging import StagedItem
from ..storage import Storage
from .state import PreparedSave, SaveTimings

_NICE = 5  # a third of a CPU's share beside a busy process: below the loop, never starved
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

    __slots__ = ("dtype", "got", "item", "shape", "window")

    def __init__(self, window: Window, item: int, dtype: np.dtype, shape: tuple[int, ...]):
        self.window, self.item, self.dtype, self.shape = window, item, dtype, shape
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


@dataclass
class Message:
    """One save, as the training process sends it to its writer (see the module's doc)."""

    template: int  # the template's number: its leaves and structure, sent once (`Template`)
    values: list[tuple[int, Leaf]]  # the leaves that are not arrays, this save's values
    digests: np.ndarray
    items: tuple[np.ndarray, list[np.ndarray], list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]
    # (leaf, start, stop, nbytes, where, later) of each staged item, as columns; where: the
    # address of its bytes, or with `data_offset` the address of its ndarray object, which
    # holds the address of its bytes `data_offset` bytes in; later: its host copy is made
    # only when the writer asks for it (`StagedLater`), where 0
    data_offset: int | None
    storage: Storage
    guarded: bool  # the storage has a commit guard, which runs in the training process
    rendezvous: tuple[str, str, float, int, int]  # prefix, what, timeout, process, count
    overwrite: bool
    options: SaveOptions
    extra: dict[str, Any]
    nonce: str
    timings: SaveTimings
    increment: Increment | None  # an incremental save's base and target (not yet opened)


@dataclass
class Template:
    """What stays the same from one save of a state to the next: its leaves (arrays without
    their values; see SaveArray.__getstate__) and the tree's structure."""

    number: int
    leaves: list[Leaf | SaveArray]
    structure: dict[str, Any]


class Link:
    """One end of the socket: pickled tuples each way (both processes frame them so), and
    the writer's calls into the training process."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._calls = threading.Lock()  # a call and its reply, one thread at a time

    def send(self, *msg: Any) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=5))

    def recv(self) -> tuple[Any, ...]:
        return tuple(pickle.loads(self.conn.recv_bytes()))

    def call(self, method: str, *args: Any) -> Any:
        with self._calls:
            self.send("call", method, args)
            kind, value = self.recv()
        if kind == "raise":
            raise value
        return value


class ProxyCoordinator(Coordinator):
    """The training process's coordinator, reached through the link (which takes one call
    at a time)."""

    def __init__(self, link: Link, process_index: int, process_count: int):
        self._link = link
        self.process_index = process_index
        self.process_count = process_count

    def set(self, key: str, value: str) -> None:
        self._link.call("set", key, value)

    def get(self, key: str, timeout_s: float) -> str:
        return str(self._link.call("get", key, timeout_s))

    def try_get(self, key: str) -> str | None:
        value = self._link.call("try_get", key)
        return None if value is None else str(value)

    def barrier(self, name: str, timeout_s: float) -> None:
        self._link.call("barrier", name, timeout_s)

    def get_dir(self, prefix: str) -> dict[str, str]:
        return dict(self._link.call("get_dir", prefix))

    def delete(self, prefix: str, keys: Any = None) -> None:
        self._link.call("delete", prefix, None if keys is None else list(keys))

    def increment(self, key: str, by: int = 1) -> int:
        return int(self._link.call("increment", key, by))

    def set_if_absent(self, key: str, value: str) -> str:
        return str(self._link.call("set_if_absent", key, value))


class _NoAdapter:
    """The adapter of a save run in the writer: every layout was described and every item
    staged by the training process, whose adapter releases what it lent when the save ends."""

    trees_differ = False

    def mesh_of(self, arr: SaveArray) -> None:
        raise AssertionError(f"leaf {arr.name!r}: its layout was not described before sending")

    def release(self) -> None:
        return None


def prepared(
    msg: Message, template: Template, link: Link, parent: int, window: Window | None
) -> PreparedSave:
    """The PreparedSave that `finish` runs on, rebuilt in the writer from `msg`, its items
    read from the training process's memory, or through `window`."""
    from .blocking import plan_save

    leaves = list(template.leaves)
    for i, value in msg.values:
        leaves[i] = value
    arrays = [x for x in leaves if isinstance(x, SaveArray)]
    prefix, what, timeout_s, index, count = msg.rendezvous
    rv = Rendezvous(ProxyCoordinator(link, index, count), prefix, what, timeout_s)
    plan = plan_save(arrays, msg.options, count)
    of_leaf, starts, stops, nbytes, addresses, later = msg.items
    if msg.data_offset is not None:  # (never through a window: sent as None)
        now = ~later
        addresses = addresses.copy()
        addresses[now] = read_words(
            parent, addresses[now].astype(np.uint64) + np.uint64(msg.data_offset)
        )
    items = []
    columns = zip(
        of_leaf.tolist(), nbytes.tolist(), addresses.tolist(), later.tolist(), strict=True
    )
    for j, (i, n, a, staged_later) in enumerate(columns):
        arr = leaves[i]
        assert isinstance(arr, SaveArray)
        start, stop = starts[j], stops[j]
        shape = tuple((stop - start).tolist())
        deferred: RemoteBytes | WindowBytes | StagedLater
        if window is not None:  # (the training process stages an item staged later itself)
            deferred = WindowBytes(window, j, arr.dtype, shape)
        else:
            remote = RemoteBytes(parent, a, arr.dtype, shape)
            deferred = StagedLater(link, j, remote) if staged_later else remote
        items.append(StagedItem(i, arr.name, start, stop, n, deferred=deferred))
    storage = msg.storage
    if msg.guarded:
        storage.commit_guard = lambda: link.call("guard")
    adapter = _NoAdapter()
    adapter.trees_differ = msg.options.trees_differ
    return PreparedSave(
        storage, rv, leaves, template.structure, plan, items, msg.overwrite, msg.options,
        msg.extra, msg.digests, msg.timings, msg.increment, nonce=msg.nonce,
        adapter=adapter,  # type: ignore[arg-type]
    )  # fmt: skip


def serve(conn: Connection, parent: int, window_fd: int = -1) -> None:
    """The writer's loop: saves one after the other until the socket closes."""
    from .commit import finish_here

    link = Link(conn)
    templates: dict[int, Template] = {}
    window: Window | None = None
    while True:
        try:
            msg = link.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "probe":
            _, address, n, expected, window_only = msg
            why = "asked to" if window_only else _unreadable(parent, address, n, expected)
            if why is None:
                link.send("ready", None)
            elif window_fd < 0:
                link.send("unable", why)
            else:
                view = np.frombuffer(mmap.mmap(window_fd, 0), np.uint8)
                window = Window(link, view)
                link.send("window", why)
        elif kind == "template":
            template = msg[1]
            templates = {template.number: template}  # one state at a time: the newest
        elif kind == "save":
            save: Message = msg[1]
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")  # the training process's filters decide
                try:
                    prep = prepared(save, templates[save.template], link, parent, window)
                    outcome: tuple[str, Any] = ("done", finish_here(prep))
                except BaseException as e:  # every failure goes back to the training process
                    outcome = ("failed", portable_error(e))
                finally:
                    save.storage.close()
            try:
                link.send(*outcome, save.storage.requests_made(), portable_warnings(warned))
            except OSError:  # the training process is gone: so is the save
                return


def _unreadable(parent: int, address: int, n: int, expected: bytes) -> str | None:
    """Why the writer cannot read `parent`'s memory (the probe's bytes there), or None."""
    out = np.empty(n, np.uint8)
    try:
        read_remote(parent, address, out)
    except OSError as e:
        return str(e)
    return None if out.tobytes() == expected else "the bytes read differ"


def portable_warnings(caught: list[warnings.WarningMessage]) -> list[tuple[type[Warning], str]]:
    """The warnings a save raised here, as (category, text) for the training process to
    raise again: a category that does not pickle goes as a UserWarning."""
    out = []
    for w in caught:
        category = w.category
        try:
            pickle.dumps(category)
        except Exception:
            category = UserWarning
        out.append((category, str(w.message)))
    return out


def portable_error(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a SnapshardError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return SnapshardError(f"{type(e).__name__}: {e}")


def main() -> None:
    # Below the training process in the CPU's scheduling: where the cores are all busy,
    # the loop goes first and the save drains in what it leaves.
    os.nice(_NICE)
    # It ends when its training process lets it go (the socket closes), never on a signal
    # sent to the whole job (Ctrl-C, a scheduler's SIGTERM): the save in flight finishes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, window_fd = int(sys.argv[-2]), int(sys.argv[-1])
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(sock.fileno()))
    sock.close()
    serve(conn, os.getppid(), window_fd)
