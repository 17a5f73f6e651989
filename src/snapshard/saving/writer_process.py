"""The background phase in a writer process (SaveOptions.background="process"): the training
process's side. The protocol and the writer's side are in writer_main.py.

Why: the background phase's Python (records, the manifest, the commit: a few microseconds
per leaf) holds the interpreter that the training loop needs, in slices of the switch
interval, whenever it runs in a thread (docs/design.md, "What the background phase takes
from the training loop"). In a process of its own it takes none of it. What stays here per
save: one message (the items' addresses as columns; the leaves only when the tree changed)
and the writer's few calls on the coordinator, answered from this thread while it waits;
with a host budget, the device-to-host copies of the items beyond it, made here when the
writer asks for each (`_stage`) and let go after (`_unstage`).

Where the writer cannot read this process's memory (a sandbox without process_vm_readv, a
kernel that forbids it), it reads the staged bytes through a window of shared memory
instead, which this process copies them into on the writer's request (`_copy`): one copy
more, made a window's worth at a time with the interpreter let go for large items, and a
run of small items per request.

One writer per training process, started at its first such save and kept for the next
(`writer()`); saves go to it one at a time. If it dies (killed, out of memory), the save it
ran fails on every process, naming it, and leaves nothing behind that its own clean-up
would not have removed (`_finish_protocol`); the next save starts a new writer.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import json
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from itertools import pairwise
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..coordination.rendezvous import report_failure
from ..errors import SnapshardError
from ..format.reading import read_manifest
from ..save_leaves import SaveArray
from ..staging import StagedItem
from ..storage import Storage
from .commit import discard_own
from .leaves import describe_layouts
from .state import PreparedSave, SaveTimings
from .writer_main import IOV_MAX, IOVEC, Link, Message, Template, portable_error

log = logging.getLogger("snapshard")

_PR_SET_PTRACER = 0x59616D61  # Yama: let this pid read our memory (process_vm_readv)
# (not `-m`: the package imports the module before runpy would run it as __main__)
_START = "from snapshard.saving.writer_main import main; main()"
_STARTUP_S = 120.0  # a writer's start: an interpreter, NumPy and snapshard imported
_WINDOW_BYTES = 64 << 20  # the shared window, where the writer reads through one
_WINDOW_ONLY = False  # read through the window even where process_vm_readv works (tests)


def unsupported(prep: PreparedSave) -> str | None:
    """Why `prep` cannot run in a writer process, or None."""
    if not sys.platform.startswith("linux"):
        return "a writer process needs Linux"
    why = prep.storage.unportable()
    if why is not None:
        return why
    base = prep.increment.base_location if prep.increment is not None else None
    if isinstance(base, Storage) and (why := base.unportable()) is not None:
        return f"its base: {why}"
    return None


class _LinkDown(Exception):
    """The socket to the writer broke: it died, or never started."""


class WriterProcess:
    """A writer process of this process's own, and the saves it runs (see the module's doc)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": package_root + (os.pathsep + path if path else "")}
        window_fd = _window_file()
        fds = (theirs.fileno(),) if window_fd < 0 else (theirs.fileno(), window_fd)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _START, str(theirs.fileno()), str(window_fd)],
                pass_fds=fds, env=env, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        except BaseException:
            mine.close()
            if window_fd >= 0:
                os.close(window_fd)
            raise
        finally:
            theirs.close()
        self._link = Link(Connection(os.dup(mine.fileno())))
        mine.close()
        self._lock = threading.Lock()  # one save at a time
        self._kept: list[np.ndarray] = []
        self._items: list[StagedItem] = []  # the save's, for the copies staged later
        self.window: np.ndarray | None = None
        self._expose([], np.zeros(0, np.int64))  # what a window's reader may ask for
        self._template: tuple[Any, np.ndarray, dict[str, Any], int] | None = None
        self._numbers = 0
        self._window_fd = window_fd  # its file, kept where the writer reads through it
        try:
            self.unable = self._probe()
        finally:
            if self.window is None and window_fd >= 0:
                os.close(window_fd)
                self._window_fd = -1

    def _send(self, *msg: Any) -> None:
        try:
            self._link.send(*msg)
        except OSError as e:
            raise _LinkDown(str(e)) from e

    def _recv(self, timeout: float | None = None) -> tuple[Any, ...]:
        try:
            if timeout is not None and not self._link.conn.poll(timeout):
                raise _LinkDown(f"no answer from the writer process in {timeout:g} s")
            return self._link.recv()
        except (EOFError, OSError) as e:
            raise _LinkDown(str(e) or "its end of the socket closed") from e

    def _probe(self) -> str | None:
        """None if the writer can read this process's memory, or else through the window
        (`window` set), else why not."""
        with contextlib.suppress(Exception):  # no Yama: nothing to allow
            ctypes.CDLL(None).prctl(_PR_SET_PTRACER, self.proc.pid, 0, 0, 0)
        probe = np.frombuffer(os.urandom(64), np.uint8).copy()
        try:
            self._send("probe", probe.ctypes.data, probe.nbytes, probe.tobytes(), _WINDOW_ONLY)
            kind, why = self._recv(_STARTUP_S)
        except _LinkDown as e:
            return f"the writer process did not start: {e}"
        if kind == "window":
            self.window = np.frombuffer(mmap.mmap(self._window_fd, 0), np.uint8)
            log.info("the writer process reads staged bytes through a shared window: %s", why)
            return None
        return None if kind == "ready" else f"it cannot read this process's memory: {why}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self._link.conn.close()
        if self._window_fd >= 0:
            os.close(self._window_fd)
            self._window_fd = -1
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def run(self, prep: PreparedSave) -> SaveTimings | None:
        """The background phase of `prep`, in the writer; raises what it raised. None where
        the writer is busy with another save (started from another thread), for the caller
        to run this one in threads: saves queued behind each other here could wait in
        another order on another process, each for the other."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._run(prep)
        finally:
            self._kept, self._items = [], []
            self._expose([], np.zeros(0, np.int64))
            self._lock.release()

    def _run(self, prep: PreparedSave) -> SaveTimings:
        t0 = time.perf_counter()
        seen = _Seen(prep)
        sent = False
        try:
            self._send_save(prep)
            sent = True
            while True:
                kind, *rest = self._recv()
                if kind != "call":
                    break
                self._answer(prep, seen, *rest)
        except BaseException as e:
            if not sent and not isinstance(e, _LinkDown):
                _finish_protocol(prep, e, seen)  # the writer never started this save
            # The writer may be reading this save's items: it goes before they do.
            if self.proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(5 if isinstance(e, _LinkDown) else 0)
            if self.proc.poll() is None:
                self.proc.kill()
            what = prep.rendezvous.what
            if isinstance(e, _LinkDown):
                error = SnapshardError(
                    f"{what}: the writer process {_death(self.proc.wait())} ({e})"
                )
            else:
                self.proc.wait()
                error = SnapshardError(f"{what}: {type(e).__name__}: {e}")
            _finish_protocol(prep, error, seen, died=True)
            prep.timings.total_s = prep.timings.blocking_s + time.perf_counter() - t0
            return prep.timings
        prep.storage.add_requests(rest[1])
        for category, text in rest[2]:
            warnings.warn(text, category, stacklevel=2)
        if kind == "failed":
            _finish_protocol(prep, rest[0], seen)
        timings: SaveTimings = rest[0]
        prep.timings.__dict__.update(timings.__dict__)
        return prep.timings

    def _send_save(self, prep: PreparedSave) -> None:
        """Send the save, keeping the copies made of items that were not contiguous, which
        the writer reads until it is done (`_kept`)."""
        number = self._template_of(prep)
        where, keep, hosts = _where(prep, direct=self.window is None)
        items = prep.items
        later = np.fromiter((h is None for h in hosts), np.bool_, len(hosts))
        msg = Message(
            template=number,
            values=[(i, x) for i, x in enumerate(prep.leaves) if not isinstance(x, SaveArray)],
            digests=prep.digests,
            items=(
                np.fromiter((it.leaf for it in items), np.int64, len(items)),
                [it.start for it in items], [it.stop for it in items],
                np.fromiter((it.nbytes for it in items), np.int64, len(items)),
                where, later,
            ),
            data_offset=_DATA_OFFSET if self.window is None else None,
            storage=prep.storage, guarded=prep.storage.commit_guard is not None,
            rendezvous=(
                prep.rendezvous.prefix, prep.rendezvous.what, prep.rendezvous.timeout_s,
                prep.rendezvous.coord.process_index, prep.rendezvous.coord.process_count,
            ),
            overwrite=prep.overwrite, options=prep.options, extra=prep.extra,
            nonce=prep.nonce, timings=prep.timings, increment=prep.increment,
        )  # fmt: skip
        self._kept, self._items = keep, items
        self._expose(hosts, where, later)
        self._send("save", msg)

    def _template_of(self, prep: PreparedSave) -> int:
        """The number of the writer's template of `prep`'s leaves, sent first if the tree
        changed: the same plan (cached per layouts), descriptions and structure."""
        t = self._template
        desc = prep.digests["description"]
        if (
            t is not None
            and t[0] is prep.plan
            and np.array_equal(t[1], desc)
            and t[2] == prep.structure
        ):
            return t[3]
        describe_layouts(prep)  # the descriptions need the framework: made here
        self._numbers += 1
        template = Template(self._numbers, list(prep.leaves), prep.structure)
        self._send("template", template)
        self._template = (prep.plan, desc.copy(), prep.structure, self._numbers)
        return self._numbers

    def _answer(self, prep: PreparedSave, seen: _Seen, method: str, args: tuple[Any, ...]) -> None:
        try:
            value = None
            if method == "copy":
                self._copy(*args)
            elif method == "stage":
                value = self._stage(*args)
            elif method == "unstage":
                self._unstage(*args)
            elif method == "guard":
                guard = prep.storage.commit_guard
                value = guard() if guard is not None else None
            else:
                value = getattr(prep.rendezvous.coord, method)(*args)
            seen.note(method, args)
        except Exception as e:
            self._send("raise", portable_error(e))
            return
        self._send("reply", value)

    def _expose(
        self, hosts: list[np.ndarray | None], addresses: np.ndarray, later: np.ndarray | None = None
    ) -> None:
        """The bytes the writer may read: `hosts` (kept alive until the save ends; None, as
        marked in `later`: an item staged later, `_stage`) at `addresses`. Their sizes are
        what a window's reads are checked against; the writer reads the others directly."""
        self._hosts, self._addresses = hosts, addresses.copy()
        self._later = set() if later is None else set(np.flatnonzero(later).tolist())
        if self.window is not None:
            self._sizes = np.fromiter(
                (0 if h is None else h.nbytes for h in hosts), np.int64, len(hosts)
            )
        else:
            self._sizes = np.zeros(len(hosts), np.int64)
        self._left: dict[int, int] = {}  # staged items' bytes not yet copied to the window

    def _stage(self, j: int) -> int:
        """Make item j's host copy, which the host budget left to the background phase (the
        device-to-host copy, made here as the threads would make it just before the write);
        the address of its bytes, held until `_unstage(j)`."""
        if j not in self._later:
            raise SnapshardError(
                f"the writer process asked to stage item {j}, not one staged later"
            )
        host = np.ascontiguousarray(self._items[j].materialize())
        self._hosts[j] = host
        self._sizes[j] = host.nbytes
        self._addresses[j] = host.__array_interface__["data"][0]
        return int(self._addresses[j])

    def _unstage(self, j: int) -> None:
        """Drop item j's host copy (`_stage`): the budget holds only those being written."""
        if j in self._later:
            self._left.pop(j, None)
            self._hosts[j] = None
            self._sizes[j] = 0

    def _copy(self, rows: np.ndarray) -> None:
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
                    self._stage(x)
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
                        self._unstage(x)

    def _write_window(self, src: np.ndarray, n: np.ndarray, at: int) -> None:
        """The bytes at addresses `src`, `n` of each, back to back into the window from
        `at`: one pwritev(2) into its file, the interpreter let go for the copy; memmove'd
        through the mapping where the file refuses it."""
        iov = np.empty(len(src), IOVEC)
        iov["base"], iov["len"] = src, n
        done = _pwritev(self._window_fd, iov.ctypes.data, len(iov), at)
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


class _Seen:
    """What the writer has told the other processes of a save so far (its calls pass here):
    whether it reported its files written, and whether process 0 published the outcome."""

    def __init__(self, prep: PreparedSave):
        rv = prep.rendezvous
        self.report_key = f"{rv.prefix}/written/{rv.coord.process_index}"
        self.outcome_key = f"{rv.prefix}/outcome"
        self.reported = False
        self.published: bool | None = None  # the outcome's "ok", once published

    def note(self, method: str, args: tuple[Any, ...]) -> None:
        if method == "set" and args[0] == self.report_key:
            self.reported = True
        elif method == "set" and args[0] == self.outcome_key:
            self.published = bool(json.loads(args[1])["ok"])


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"ended with exit code {code}"


def _finish_protocol(
    prep: PreparedSave, error: BaseException, seen: _Seen, *, died: bool = False
) -> None:
    """The save failed with `error` in the writer, or the writer died (`died`): this
    process finishes the writer's part of the protocol in its place, so that every process
    learns the outcome in bounded time and what it staged goes (as commit.finish_here's
    protocol would). Returns only where the save is committed after all: the writer died
    after its part (process 0: after the rename; another process: after reporting its
    files, when process 0 commits)."""
    rv = prep.rendezvous
    if seen.reported and not died:
        raise error  # the writer ran the protocol to its end: the others know
    if rv.coord.is_leader:
        if seen.published is not None:  # the others know; only the clean-up may be left
            if seen.published:
                return
            prep.storage.discard_staging()
            raise error
        if died and _committed_by(prep):
            rv.publish_outcome()
            return
        rv.publish_outcome(error)
        prep.storage.discard_staging()
        raise error
    if seen.reported:
        rv.start_clock()
        rv.await_outcome()  # raises the save's failure
        return
    cause = report_failure(rv, error)
    discard_own(prep, cause is not None)
    if cause is not None:
        raise cause from error
    raise error


def _committed_by(prep: PreparedSave) -> bool:
    """Whether the checkpoint at `prep`'s location is `prep`'s own: its writer died after
    the rename. Told by process 0's nonce in the manifest, never by what is there: an
    overwritten checkpoint is there until the rename."""
    try:
        manifest = read_manifest(prep.storage)
    except SnapshardError:
        return False
    nonces = manifest.processes.nonces if manifest.processes is not None else []
    return bool(nonces) and nonces[0] == prep.nonce


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


def _where(
    prep: PreparedSave, *, direct: bool
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray | None]]:
    """Where each staged item's bytes are: for a writer reading this process's memory
    (`direct`), its ndarray object's address (id) where _DATA_OFFSET is known (0.05 us an
    item, where asking each array for its address costs microseconds), else the bytes'
    address, which a window's copies read from; the C-contiguous copies made of the items
    that were not, kept until the save ends; and each item's bytes C-contiguous, None for
    an item whose copy the host budget left to the background phase (address 0)."""
    hosts: list[np.ndarray | None] = []
    keep: list[np.ndarray] = []
    for it in prep.items:
        host = it.host
        if host is not None and not host.flags.c_contiguous:
            host = np.ascontiguousarray(host)
            keep.append(host)
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
    if len(present) < len(hosts):  # items staged later (`WriterProcess._stage`): 0
        full = np.zeros(len(hosts), np.int64)
        full[[i for i, h in enumerate(hosts) if h is not None]] = where
        where = full
    return where, keep, hosts


def _window_file() -> int:
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


_writer: WriterProcess | None = None
_unusable: str | None = None  # why this process's writers cannot run saves: never again
_writer_lock = threading.Lock()
_told: set[str] = set()


def writer() -> WriterProcess | None:
    """This process's writer, started if it has none (or its last one died); None where
    none can run here (said once)."""
    global _writer, _unusable
    with _writer_lock:
        if _unusable is None and (_writer is None or not _writer.alive()):
            try:
                _writer = WriterProcess()
                _unusable = _writer.unable
            except (OSError, subprocess.SubprocessError) as e:
                _unusable = f"the writer process could not be started: {e}"
            if _unusable is not None:
                _tell(_unusable)
                if _writer is not None:
                    _writer.close()
                _writer = None
        return _writer


def start_writer_soon() -> None:
    """Start this process's writer in a thread of its own, unless it has one (a
    CheckpointManager asks when it is made): a writer's start (an interpreter, its imports:
    0.3 to 0.5 s) is then not in its first save's background phase."""
    if sys.platform.startswith("linux") and _unusable is None and _writer is None:
        threading.Thread(target=writer, name="snapshard: writer start", daemon=True).start()


def _tell(why: str) -> None:
    """Say once per reason why saves that asked for a writer process run in threads."""
    if why not in _told:
        _told.add(why)
        log.warning("a save's background phase runs in threads, not a writer process: %s", why)


def finish_in_writer(prep: PreparedSave) -> SaveTimings | None:
    """The background phase of `prep` in this process's writer; None (said once) where it
    cannot run there, for the caller to run it in threads."""
    why = unsupported(prep)
    if why is not None:
        _tell(why)
        return None
    w = writer()
    return w.run(prep) if w is not None else None


def stop_writer() -> None:
    """Let this process's writer go (it ends when its socket closes); the next save that
    asks for one starts another."""
    global _writer
    with _writer_lock:
        w, _writer = _writer, None
    if w is not None:
        w.close()


def _forget_in_child() -> None:
    """A forked child (a data loader's worker) does not share its parent's writer."""
    global _writer, _writer_lock
    if _writer is not None:
        with contextlib.suppress(OSError):
            _writer._link.conn.close()
    _writer, _writer_lock = None, threading.Lock()


atexit.register(stop_writer)  # (after the saves in flight: their threads are joined first)
if hasattr(os, "register_at_fork"):  # (POSIX; elsewhere saves run in threads)
    os.register_at_fork(after_in_child=_forget_in_child)
