"""The background phase in a writer process (SaveOptions.background="process"): the training
process's side. The protocol is in writer_protocol.py, the writer's side in writer_main.py.

Why: the background phase's Python (records, the manifest, the commit: a few microseconds
per leaf) holds the interpreter that the training loop needs, in slices of the switch
interval, whenever it runs in a thread (docs/design.md, "What the background phase takes
from the training loop"). In a process of its own it takes none of it. What stays here per
save: one message (the items' addresses as columns; the leaves only when the tree changed)
and the writer's few calls, answered from this thread while it waits: on the coordinator,
and on the staged bytes (writer_exposure.py).

One writer per training process, started at its first such save and kept for the next
(`writer()`); saves go to it one at a time. If it dies (killed, out of memory), the save it
ran fails on every process, naming it, and leaves nothing behind that its own clean-up
would not have removed (writer_failure.py); the next save starts a new writer.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..errors import SnapshardError
from ..storage import Storage
from .leaves import describe_layouts
from .save_array import SaveArray
from .state import PreparedSave, SaveTimings
from .writer_exposure import Exposure, addresses_of, window_file
from .writer_failure import Seen, finish_protocol
from .writer_protocol import Link, Message, Template, portable_error

log = logging.getLogger("snapshard")

_PR_SET_PTRACER = 0x59616D61  # Yama: let this pid read our memory (process_vm_readv)
# (not `-m`: the package imports the module before runpy would run it as __main__)
_START = "from snapshard.saving.writer_main import main; main()"
_STARTUP_S = 120.0  # a writer's start: an interpreter, NumPy and snapshard imported
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
        window_fd = window_file()
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
        self.exposure = Exposure(window_fd)  # what the writer may read, and the window
        self._template: tuple[Any, np.ndarray, dict[str, Any], int] | None = None
        self._numbers = 0
        try:
            self.unable = self._probe()
        finally:
            if self.exposure.window is None:
                self.exposure.close()

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
        (`exposure.window` set), else why not."""
        with contextlib.suppress(Exception):  # no Yama: nothing to allow
            ctypes.CDLL(None).prctl(_PR_SET_PTRACER, self.proc.pid, 0, 0, 0)
        probe = np.frombuffer(os.urandom(64), np.uint8).copy()
        try:
            self._send("probe", probe.ctypes.data, probe.nbytes, probe.tobytes(), _WINDOW_ONLY)
            kind, why = self._recv(_STARTUP_S)
        except _LinkDown as e:
            return f"the writer process did not start: {e}"
        if kind == "window":
            self.exposure.map_window()
            log.info("the writer process reads staged bytes through a shared window: %s", why)
            return None
        return None if kind == "ready" else f"it cannot read this process's memory: {why}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self._link.conn.close()
        self.exposure.close()
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
            self.exposure.release()
            self._lock.release()

    def _run(self, prep: PreparedSave) -> SaveTimings:
        t0 = time.perf_counter()
        seen = Seen(prep)
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
                finish_protocol(prep, e, seen)  # the writer never started this save
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
            finish_protocol(prep, error, seen, died=True)
            prep.timings.total_s = prep.timings.blocking_s + time.perf_counter() - t0
            return prep.timings
        prep.storage.add_requests(rest[1])
        for category, text in rest[2]:
            warnings.warn(text, category, stacklevel=2)
        if kind == "failed":
            finish_protocol(prep, rest[0], seen)
        timings: SaveTimings = rest[0]
        prep.timings.__dict__.update(timings.__dict__)
        return prep.timings

    def _send_save(self, prep: PreparedSave) -> None:
        """Send the save, its items' bytes exposed to the writer until it is done."""
        number = self._template_of(prep)
        where, hosts, data_offset = addresses_of(prep, direct=self.exposure.window is None)
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
            data_offset=data_offset,
            storage=prep.storage, guarded=prep.storage.commit_guard is not None,
            rendezvous=(
                prep.rendezvous.prefix, prep.rendezvous.what, prep.rendezvous.timeout_s,
                prep.rendezvous.coord.process_index, prep.rendezvous.coord.process_count,
            ),
            overwrite=prep.overwrite, options=prep.options, extra=prep.extra,
            nonce=prep.nonce, timings=prep.timings, increment=prep.increment,
            copies=prep.copies,
        )  # fmt: skip
        self.exposure.expose(items, hosts, where, later)
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

    def _answer(self, prep: PreparedSave, seen: Seen, method: str, args: tuple[Any, ...]) -> None:
        try:
            value = None
            if method == "copy":
                self.exposure.copy(*args)
            elif method == "stage":
                value = self.exposure.stage(*args)
            elif method == "unstage":
                self.exposure.unstage(*args)
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


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"ended with exit code {code}"


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
