"""Staging directories that killed saves left: finding them, judged by their writers'
owner records (owner_records.py), and removing those whose writers are provably gone.

A directory without any record (a save of an older version, or one made this instant and
not yet recorded) is unknown: only `snapshard clean --unknown` removes it.

A local commit sweeps the checkpoint's parent once (one scandir, in the background phase:
the blocking phase only writes the record): each stale staging directory is renamed aside to
`<name>.snapshard-deleting-stale-<hex>`, checked again (a writer that recorded itself
meanwhile gets it back) and deleted in a background thread, records last, so that a sweep
interrupted half-way leaves a directory the next sweep still recognises. A writer racing
with the removal finds its directory gone and fails; it never commits a checkpoint with
files missing. Process 0's commit removes the records with the other files no save reported,
before the rename, so committed checkpoints carry none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .owner_records import (
    ALIVE,
    GONE,
    UNKNOWN,
    Identity,
    Owner,
    is_owner_record,
    judge,
    read_record,
)

# A local checkpoint D is staged in D + STAGING_SUFFIX + "-<job>-<n>" (local.py), and a
# replaced or deleted one is moved aside to D + DELETING_SUFFIX + <random> first.
STAGING_SUFFIX = ".snapshard-tmp"
DELETING_SUFFIX = ".snapshard-deleting"

log = logging.getLogger("snapshard")

TRASH_MARK = "-stale-"
_removals: list[threading.Thread] = []
_removals_lock = threading.Lock()


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
        identity = read_record(path, name)
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
