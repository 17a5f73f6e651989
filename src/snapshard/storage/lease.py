"""The writer lease of a checkpoint root: one writer (one CheckpointManager) per root.

The lease is a small JSON document under the root, in `.snapshard-writer/<generation>.json`.
The holder is the document of the highest generation. Acquiring creates generation 1 if
there is none, or, to take over a stale lease, generation g + 1; creation is exclusive
(a hard link on POSIX, a conditional PUT `If-None-Match: *` on object stores: the roots'
LeaseFiles, in local_root.py and objstore.py), so of two writers racing for the same
generation exactly one wins. The holder rewrites its own document every `timeout_s / 6`
seconds (a heartbeat counter); it never touches another generation's, so heartbeats cannot
undo a take-over.

A lease is stale when its holder stopped beating: on the same host, when its process is
gone or its last beat (by the host's clock) is older than `timeout_s`; from another host,
when its beat counter does not change for `timeout_s` of watching (no clocks compared).
A document of this very process that none of its leases holds any more (its removal
failed) is stale at once.
A fresh lease held by a live process fails at once (same host) or within one heartbeat
(another host), with a WriterLeaseError naming the holder. `takeover=True` takes the
lease whatever its state (for a scheduler that knows the old job is gone). A lease held by
another writer of this very process (two managers on one root) is refused naming that
writer by its `owner` text (where it was made), never as another job, and never with the
advice to take it over.

Only writers take the lease: loading, listing and evaluation jobs read beside a holder
without one (the manager takes it at its first save, see manager/writer.py).

The holder checks before each commit and each deletion that its generation is still the
highest (`verify`), so a writer that lost the lease (it was paused for longer than the
timeout and taken over) stops instead of committing over the new writer's steps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from datetime import UTC, datetime
from typing import Any

from ..errors import WriterLeaseError

log = logging.getLogger("snapshard")

LEASE_DIR = ".snapshard-writer"
DEFAULT_LEASE_TIMEOUT_S = 30.0
_NAME = re.compile(r"^(\d{8})\.json$")
# Tokens of the leases this process holds now, with their owners' descriptions. A document
# naming this process with another token is stale: its writer gave the lease up (or never
# finished taking it) but could not remove the document.
_held: dict[str, str] = {}
_held_lock = threading.Lock()


class LeaseFiles(ABC):
    """The few operations a lease needs from a root, on names inside LEASE_DIR."""

    where: str

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def read(self, name: str) -> bytes | None: ...

    @abstractmethod
    def create(self, name: str, data: bytes) -> bool:
        """Create `name` with `data` only if it does not exist; False if it does."""

    @abstractmethod
    def replace(self, name: str, data: bytes) -> None:
        """Atomically replace `name` (readers see the old or the new document)."""

    @abstractmethod
    def remove(self, name: str) -> None: ...


def _this_host() -> str:
    return socket.gethostname()


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _process_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of process `pid` from
    /proc/<pid>/stat; None when no such process runs."""
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields follow the last ')'.
    fields = text.rpartition(")")[2].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs: a zombie (killed, its parent has not reaped
    it yet: a supervisor that restarts the job first) holds nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    stat = _process_stat(pid)  # (None without /proc: the signal's answer stands)
    return stat is None or stat[0] not in ("Z", "X")


def describe_holder(doc: dict[str, Any]) -> str:
    return (
        f"host {doc.get('host')!r}, pid {doc.get('pid')}, since {doc.get('started')} "
        f"(heartbeat {doc.get('beat')})"
    )


class WriterLease:
    """The writer lease of one root, for one writer. `owner` describes the writer to
    another writer of this process that finds the lease held (e.g. "CheckpointManager
    created at train.py:12"); it stays in this process, never in the document."""

    def __init__(
        self,
        files: LeaseFiles,
        *,
        timeout_s: float = DEFAULT_LEASE_TIMEOUT_S,
        owner: str | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"lease timeout must be positive, got {timeout_s!r}")
        self.files = files
        self.timeout_s = float(timeout_s)
        self.token = uuid.uuid4().hex
        self.owner = owner or f"WriterLease {self.token[:8]}"
        self.generation: int | None = None
        now = time.time()
        self.doc: dict[str, Any] = {
            "host": _this_host(),
            "pid": os.getpid(),
            "started": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"),
            "token": self.token,
            "beat": 0,
            "beat_unix": now,
            "timeout_s": self.timeout_s,
        }
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # A writer dropped without release() gives the lease up when garbage-collected
        # (the heartbeat thread holds only a weak reference).
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def interval_s(self) -> float:
        return self.timeout_s / 6

    # ---- generations -------------------------------------------------------------------
    def _generations(self) -> list[int]:
        out = []
        for n in self.files.names():
            m = _NAME.match(n)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    @staticmethod
    def _name(gen: int) -> str:
        return f"{gen:08d}.json"

    def _read(self, gen: int) -> dict[str, Any] | None:
        raw = self.files.read(self._name(gen))
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            return doc if isinstance(doc, dict) else {}
        except ValueError:
            return {}  # unreadable (a writer died mid-write on a store without atomic puts)

    def _encode(self) -> bytes:
        return json.dumps(self.doc).encode()

    # ---- acquiring ---------------------------------------------------------------------
    def acquire(self, *, takeover: bool = False) -> None:
        """Take the lease, or raise WriterLeaseError naming the live holder."""
        for _ in range(50):
            gens = self._generations()
            if not gens:
                if self.files.create(self._name(1), self._encode()):
                    self._won(1, None)
                    return
                continue
            top = gens[-1]
            other = self._read(top)
            if other is None:
                continue  # released meanwhile
            if other.get("token") == self.token:
                return
            if not takeover:
                self._check_stale(top, other)
            if self.files.create(self._name(top + 1), self._encode()):
                self._won(top + 1, other)
                with contextlib.suppress(OSError):  # older documents never hold the lease
                    for g in gens:
                        self.files.remove(self._name(g))
                return
        raise WriterLeaseError(f"{self.files.where}: could not take the writer lease (contended)")

    def _check_stale(self, gen: int, other: dict[str, Any]) -> None:
        """Return if the lease of generation `gen` is stale; raise naming its holder if not."""
        if other.get("pid") == os.getpid() and other.get("host") == _this_host():
            with _held_lock:
                owner = _held.get(str(other.get("token")))
            if owner is not None:
                raise self._refuse_own(owner, other)
        holder = describe_holder(other)
        refuse = WriterLeaseError(
            f"{self.files.where}: another writer holds this checkpoint root: {holder}. "
            f"Two writers on one root could corrupt it; stop the other job, or wait "
            f"{other.get('timeout_s', self.timeout_s):g} s after it died, or pass "
            f"takeover=True if it is known to be gone (a CheckpointManager: "
            f"policies=ManagerPolicies(lease=LeasePolicy(takeover=True)))",
            other,
        )
        timeout = float(other.get("timeout_s") or self.timeout_s)
        if other.get("host") == _this_host() and isinstance(other.get("pid"), int):
            beat_age = time.time() - float(other.get("beat_unix") or 0)
            # (this process's own document, held by none of its writers: stale at once)
            if other["pid"] != os.getpid() and _pid_alive(other["pid"]) and beat_age <= timeout:
                raise refuse
            log.warning("%s: taking over the stale writer lease of %s", self.files.where, holder)
            return
        # Another host: no clocks compared; the holder is alive if its counter moves.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(min(0.5, timeout / 12))
            now = self._read(gen)
            if now is None:
                return  # released
            if now.get("beat") != other.get("beat") or now.get("token") != other.get("token"):
                raise refuse
            if self._generations()[-1:] != [gen]:
                raise refuse  # someone else took it over meanwhile
        log.warning(
            "%s: taking over the writer lease of %s: no heartbeat for %g s",
            self.files.where,
            holder,
            timeout,
        )

    def _refuse_own(self, owner: str, other: dict[str, Any]) -> WriterLeaseError:
        """The refusal when a writer of this very process holds the lease: it names that
        writer; taking over would only fence this process's own writer."""
        return WriterLeaseError(
            f"{self.files.where}: another writer of this process holds this checkpoint "
            f"root's writer lease: {owner} ({describe_holder(other)}). One root takes one "
            f"writer: close that one first (its close(), or the end of its with block), or "
            f"save through it",
            other,
        )

    def _won(self, gen: int, previous: dict[str, Any] | None) -> None:
        self.generation = gen
        self.lost = None
        with _held_lock:
            _held[self.token] = self.owner
        if previous:
            self.doc["took_over"] = {k: previous.get(k) for k in ("host", "pid", "started")}
        self._stop.clear()
        self._thread = threading.Thread(
            target=_beat,
            args=(weakref.ref(self), self._stop),
            daemon=True,
            name="snapshard-lease",
        )
        self._thread.start()
        self._finalizer = weakref.finalize(
            self, _release, self.files, self._name(gen), self._stop, self.token
        )

    # ---- holding -----------------------------------------------------------------------
    def beat(self) -> None:
        """One heartbeat: check the lease is still ours, then rewrite our document."""
        if self.generation is None or self.lost:
            return
        gens = self._generations()
        if not gens or gens[-1] != self.generation:
            newer = self._read(gens[-1]) if gens else None
            self.lost = (
                f"taken over by {describe_holder(newer)}" if newer else "its document was removed"
            )
            log.error("%s: this writer lost its writer lease: %s", self.files.where, self.lost)
            self._stop.set()
            return
        self.doc["beat"] += 1
        self.doc["beat_unix"] = time.time()
        self.files.replace(self._name(self.generation), self._encode())

    def check(self) -> None:
        """Raise if the heartbeat found the lease lost (no I/O)."""
        if self.lost:
            raise WriterLeaseError(
                f"{self.files.where}: this writer lost its writer lease ({self.lost}); "
                f"it saves and deletes nothing more"
            )
        if self.generation is None:
            raise WriterLeaseError(f"{self.files.where}: the writer lease is not held")

    def verify(self) -> None:
        """Before a commit or a deletion: the lease is still ours (one listing)."""
        self.check()
        gens = self._generations()
        if not gens or gens[-1] != self.generation:
            self.lost = "a newer writer holds it"
            self.check()

    def release(self) -> None:
        """Give the lease up (if still ours); the next writer takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self.generation is not None:
            # Only this writer's own document is removed; a newer one (a take-over) stays.
            with contextlib.suppress(OSError):
                self.files.remove(self._name(self.generation))
            with _held_lock:
                _held.pop(self.token, None)
            self.generation = None


def _beat(ref: weakref.ref[WriterLease], stop: threading.Event) -> None:
    while True:
        lease = ref()
        if lease is None:
            return
        interval = lease.interval_s
        del lease
        if stop.wait(interval):
            return
        lease = ref()
        if lease is None:
            return
        try:
            lease.beat()
        except Exception as e:  # a failed beat is retried; the timeout is several beats
            log.warning("%s: writer lease heartbeat failed: %s", lease.files.where, e)
        del lease


def _release(files: LeaseFiles, name: str, stop: threading.Event, token: str) -> None:
    stop.set()
    with contextlib.suppress(Exception):
        files.remove(name)
    with _held_lock:
        _held.pop(token, None)
