"""Staging directories that killed saves left: who wrote them, and removing those whose
writers are provably gone.

A local save stages in `D.snapshard-tmp-<job>-<n>` (local.py) and a kill leaves it there,
full size. So every process that writes into a staging directory first puts an owner record
in it, `.owner-<pid>-<key>.json`: its host name, the kernel's boot id, its pid namespace,
its pid and the time the kernel started it. The job owns the directory, not the process
that made it: the directory is stale when every record's process is provably gone —

- same host name, boot id and pid namespace: the pid runs no process, or one started at
  another time (the pid was reused), or a zombie;
- same host name, another boot id: the machine has rebooted since;
- another host, or another pid namespace (a container): unknown. Its processes cannot be
  seen from here, and clocks are not compared, so such a directory is left alone.

A directory without any record (a save of an older version, or one made this instant and
not yet recorded) is unknown too: only `snapshard clean --unknown` removes it.

A local commit sweeps the checkpoint's parent once (one scandir, in the background phase:
the blocking phase only writes the record): each
stale staging directory is renamed aside to `<name>.snapshard-deleting-stale-<hex>`, checked
again (a writer that recorded itself meanwhile gets it back) and deleted in a background
thread, records last, so that a sweep interrupted half-way leaves a directory the next
sweep still recognises. A writer racing with the removal finds its directory gone and fails;
it never commits a checkpoint with files missing. Process 0's commit removes the records
with the other files no save reported, before the rename, so committed checkpoints carry
none.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .lease import _pid_alive, _this_host

# A local checkpoint D is staged in D + STAGING_SUFFIX + "-<job>-<n>" (local.py), and a
# replaced or deleted one is moved aside to D + DELETING_SUFFIX + <random> first.
STAGING_SUFFIX = ".snapshard-tmp"
DELETING_SUFFIX = ".snapshard-deleting"

log = logging.getLogger("snapshard")

OWNER_PREFIX = ".owner-"
OWNER_SUFFIX = ".json"
TRASH_MARK = "-stale-"
ALIVE, GONE, UNKNOWN = "alive", "gone", "unknown"
_MAX_RECORD_BYTES = 4096
_removals: list[threading.Thread] = []
_removals_lock = threading.Lock()


def is_owner_record(name: str) -> bool:
    """`name` (relative to a staging directory) is a writer's owner record, not a file of
    the checkpoint."""
    return name.startswith(OWNER_PREFIX) and name.endswith(OWNER_SUFFIX) and "/" not in name


# ---- who this process is ----------------------------------------------------------------
def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _boot_id() -> str | None:
    """The kernel's id of this boot (Linux); None elsewhere."""
    text = _read_text("/proc/sys/kernel/random/boot_id")
    return text.strip() if text else None


def _pid_namespace() -> str | None:
    """The pid namespace of this process ('pid:[4026531836]'); pids are compared only within
    one. None where the kernel does not say (not Linux)."""
    try:
        return os.readlink("/proc/self/ns/pid")
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


@dataclass(frozen=True)
class Identity:
    """What tells one process apart from every other, now and after it is gone."""

    host: str
    boot: str | None
    pidns: str | None
    pid: int
    start: int | None

    def key(self) -> str:
        raw = f"{self.host}|{self.boot}|{self.pidns}|{self.pid}|{self.start}".encode()
        return hashlib.blake2s(raw, digest_size=6).hexdigest()

    def record_name(self) -> str:
        return f"{OWNER_PREFIX}{self.pid}-{self.key()}{OWNER_SUFFIX}"


_identity: Identity | None = None


def this_process() -> Identity:
    """This process's identity (computed again in a forked child: its pid differs)."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity.pid != pid:
        stat_ = _process_stat(pid)
        _identity = Identity(
            _this_host(), _boot_id(), _pid_namespace(), pid, stat_[1] if stat_ else None
        )
    return _identity


# ---- owner records ----------------------------------------------------------------------
def ensure_owner_record(staging: Path) -> bool:
    """Record this process as a writer of `staging` (once: a record already there is kept);
    False if it could not be written. Best effort: without its record the directory is only
    never removed automatically, while failing here would hide the save's own error (a full
    disk fails the data files next, naming them)."""
    me = this_process()
    path = staging / me.record_name()
    if os.path.lexists(path):
        return True
    doc = {
        "version": 1,
        "host": me.host,
        "boot": me.boot,
        "pidns": me.pidns,
        "pid": me.pid,
        "start": me.start,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, json.dumps(doc).encode())
        finally:
            os.close(fd)
    except OSError as e:
        with contextlib.suppress(OSError):  # a partial record could not be judged anyway
            path.unlink(missing_ok=True)
        log.warning(
            "%s: could not record this process as its writer (%s); if this save is killed, "
            "its staging directory stays until `snapshard clean --unknown` removes it",
            staging,
            e,
        )
        return False
    return True


def remove_own_record(staging: Path) -> None:
    """Take this process's record out of `staging` (it writes no more there). Best effort."""
    with contextlib.suppress(OSError):
        (staging / this_process().record_name()).unlink(missing_ok=True)


def _read_record(directory: Path, name: str) -> Identity | None:
    """The identity in record `name`; None when it is not a regular file of a sane size or
    does not parse (a writer killed while writing it)."""
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_RECORD_BYTES:
            return None
        doc = json.loads(os.read(fd, _MAX_RECORD_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return _identity_of(doc)


def _identity_of(doc: Any) -> Identity | None:
    if not isinstance(doc, dict):
        return None
    host, pid, start = doc.get("host"), doc.get("pid"), doc.get("start")
    boot, pidns = doc.get("boot"), doc.get("pidns")
    if not isinstance(host, str) or type(pid) is not int or pid <= 0:
        return None
    if not all(v is None or isinstance(v, str) for v in (boot, pidns)):
        return None
    if start is not None and type(start) is not int:
        return None
    return Identity(host, boot, pidns, pid, start)


@dataclass(frozen=True)
class Owner:
    """One writer of a staging directory, and whether it still runs."""

    identity: Identity
    state: str
    why: str

    def to_json(self) -> dict[str, Any]:
        i = self.identity
        return {"host": i.host, "pid": i.pid, "state": self.state, "why": self.why}


def judge(owner: Identity, here: Identity | None = None) -> Owner:
    """Whether the process `owner` is alive, provably gone, or cannot be seen from here."""
    here = here or this_process()
    if owner.host != here.host:
        return Owner(owner, UNKNOWN, "another host: its processes cannot be seen from here")
    if owner.boot is not None and here.boot is not None and owner.boot != here.boot:
        return Owner(owner, GONE, "this host has rebooted since")
    if owner.boot != here.boot or owner.pidns != here.pidns:
        return Owner(owner, UNKNOWN, "another pid namespace (a container) on this host")
    if here.boot is None:  # no /proc: the pid alone (a reused pid counts as alive)
        if _pid_alive(owner.pid):
            return Owner(owner, ALIVE, "running")
        return Owner(owner, GONE, "not running")
    now = _process_stat(owner.pid)
    if now is None:
        return Owner(owner, GONE, "not running")
    if owner.start is not None and now[1] != owner.start:
        return Owner(owner, GONE, "not running (its pid belongs to a newer process)")
    if now[0] in ("Z", "X"):
        return Owner(owner, GONE, "exited")
    return Owner(owner, ALIVE, "running")


# ---- the unfinished saves beside checkpoints --------------------------------------------
@dataclass(frozen=True)
class Unfinished:
    """A directory an unfinished save or deletion left beside the checkpoints: a staging
    directory, the rest of a sweep's removal, or a checkpoint being deleted."""

    path: Path
    checkpoint: str
    kind: str  # "staging", "trash" (a sweep's removal) or "deleting"
    owners: tuple[Owner, ...]
    state: str
    why: str

    def size(self) -> int:
        """Bytes of the files under it (symbolic links not followed)."""
        return sum(st.st_size for st in _walk_stats(self.path))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.path.name,
            "checkpoint": self.checkpoint,
            "kind": self.kind,
            "state": self.state,
            "why": self.why,
            "owners": [o.to_json() for o in self.owners],
            "bytes": self.size(),
        }


def _walk_stats(path: Path) -> Iterator[os.stat_result]:
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from _walk_stats(Path(entry.path))
            else:
                yield entry.stat(follow_symlinks=False)
        except OSError:
            continue


def classify(name: str) -> tuple[str, str] | None:
    """(checkpoint name, kind) of an entry of a checkpoints' parent; None for others."""
    if STAGING_SUFFIX in name:
        return name[: name.index(STAGING_SUFFIX)], "staging"
    if DELETING_SUFFIX in name:
        base, _, rest = name.partition(DELETING_SUFFIX)
        return base, "trash" if rest.startswith(TRASH_MARK) else "deleting"
    return None


def inspect(path: Path, checkpoint: str, kind: str, here: Identity | None = None) -> Unfinished:
    """An unfinished save's directory, its owners judged."""
    owners: list[Owner] = []
    try:
        names = [e.name for e in os.scandir(path) if is_owner_record(e.name)]
    except OSError:
        names = []
    unreadable = 0
    for name in sorted(names):
        identity = _read_record(path, name)
        if identity is None:
            unreadable += 1
        else:
            owners.append(judge(identity, here))
    state, why = _verdict(kind, owners, unreadable)
    return Unfinished(path, checkpoint, kind, tuple(owners), state, why)


def _verdict(kind: str, owners: list[Owner], unreadable: int) -> tuple[str, str]:
    """The directory's state from its owners': alive if one runs, gone if all are gone."""
    if kind == "deleting":
        return UNKNOWN, "a checkpoint being deleted or replaced (no owner recorded)"
    if any(o.state == ALIVE for o in owners):
        return ALIVE, "a writer is running"
    if unreadable:
        return UNKNOWN, f"{unreadable} owner record(s) unreadable"
    if any(o.state == UNKNOWN for o in owners):
        return UNKNOWN, "a writer cannot be seen from here"
    if owners:
        return GONE, "every writer is gone"
    if kind == "trash":  # records go last: none left means the removal had nearly ended
        return GONE, "the rest of an interrupted removal"
    return UNKNOWN, "no owner recorded (an older version's save, or one just starting)"


def find(parent: Path, here: Identity | None = None) -> list[Unfinished]:
    """Every unfinished save's directory in `parent` (one scandir), judged."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    out = []
    for entry in entries:
        found = classify(entry.name)
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if found is not None and is_dir:
            out.append(inspect(Path(entry.path), found[0], found[1], here))
    return sorted(out, key=lambda u: u.path.name)


# ---- removing ---------------------------------------------------------------------------
def set_aside(u: Unfinished) -> Path | None:
    """Rename `u` out of any writer's way, to be deleted; None when it is not removable any
    more (gone meanwhile, or a writer recorded itself between the judgement and the rename:
    it is then put back where that writer expects it)."""
    if u.kind == "trash":
        return u.path
    trash = u.path.with_name(f"{u.checkpoint}{DELETING_SUFFIX}{TRASH_MARK}{uuid.uuid4().hex[:8]}")
    try:
        os.rename(u.path, trash)
    except FileNotFoundError:
        return None
    again = inspect(trash, u.checkpoint, u.kind)
    if any(o.state == ALIVE for o in again.owners):
        with contextlib.suppress(OSError):  # a running writer's: give it back
            os.rename(trash, u.path)
        return None
    return trash


def delete(trash: Path) -> None:
    """Delete a set-aside directory, its owner records last (best effort)."""
    try:
        entries = list(os.scandir(trash))
    except OSError:
        return
    for entry in entries:
        if is_owner_record(entry.name):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)
    shutil.rmtree(trash, ignore_errors=True)


def _delete_all(trash: list[Path]) -> None:
    for t in trash:
        delete(t)


def _delete_in_background(trash: list[Path]) -> None:
    """Delete in a thread that the interpreter waits for at exit (not a daemon: a thread
    killed at exit would leave the deletion half done)."""
    thread = threading.Thread(target=_delete_all, args=(trash,), name="snapshard-stale-staging")
    with _removals_lock:
        _removals[:] = [t for t in _removals if t.is_alive()]
        _removals.append(thread)
    thread.start()


def wait_for_removals(timeout_s: float = 60.0) -> bool:
    """Wait until the background deletions started so far have ended; False on timeout."""
    deadline = time.monotonic() + timeout_s
    with _removals_lock:
        threads = list(_removals)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def sweep(parent: Path, keep: Path) -> list[str]:
    """Remove the staging directories in `parent` whose writers are all provably gone
    (never `keep`, the caller's own), and what an interrupted sweep left; the names
    removed. The deletion runs in a thread of its own: the caller (a commit) waits for one
    scandir and a rename per stale directory only. Never raises."""
    removed: dict[str, Path] = {}
    for u in find(parent):
        if u.state != GONE or u.path == keep:
            continue
        try:
            trash = set_aside(u)
        except OSError as e:  # the save goes on; `snapshard clean` reports it again
            log.warning("%s: could not remove what a killed save left: %s", u.path, e)
            continue
        if trash is not None:
            removed[u.path.name] = trash
    if removed:
        log.info("%s: removing what killed saves left: %s", parent, ", ".join(sorted(removed)))
        _delete_in_background(list(removed.values()))
    return sorted(removed)
