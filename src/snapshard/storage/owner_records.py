"""Who writes a staging directory: each writing process's owner record, and whether the
process of a record still runs.

A local save stages in `D.snapshard-tmp-<job>-<n>` (local.py) and a kill leaves it there,
full size. So every process that writes into a staging directory first puts an owner record
in it, `.owner-<pid>-<key>.json`: its host name, the kernel's boot id, its pid namespace,
its pid and the time the kernel started it. The job owns the directory, not the process
that made it: the directory is stale when every record's process is provably gone
(stale_staging.py) —

- same host name, boot id and pid namespace: the pid runs no process, or one started at
  another time (the pid was reused), or a zombie;
- same host name, another boot id: the machine has rebooted since;
- another host, or another pid namespace (a container): unknown. Its processes cannot be
  seen from here, and clocks are not compared, so such a directory is left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .lease import _pid_alive, _process_stat, _read_text, _this_host

log = logging.getLogger("snapshard")

OWNER_PREFIX = ".owner-"
OWNER_SUFFIX = ".json"
ALIVE, GONE, UNKNOWN = "alive", "gone", "unknown"
_MAX_RECORD_BYTES = 4096


def is_owner_record(name: str) -> bool:
    """`name` (relative to a staging directory) is a writer's owner record, not a file of
    the checkpoint."""
    return name.startswith(OWNER_PREFIX) and name.endswith(OWNER_SUFFIX) and "/" not in name


# ---- who this process is ----------------------------------------------------------------
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


def read_record(directory: Path, name: str) -> Identity | None:
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
