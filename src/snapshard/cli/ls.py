"""`snapshard ls DIR`: the checkpoints (a manager's steps) under a directory, and beside
each one what unfinished saves left (their staging directories: who wrote them, whether
those processes still run, how big they are; `snapshard clean` removes the stale ones)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, SnapshardError
from ..format import DATA_DIR, INDEX_DIR
from ..format.reading import read_summary
from ..orbax.foreign import holds_orbax_markers, looks_like_orbax
from ..orbax.meta import step_order
from ..storage import CheckpointRoot, root_for, stale_staging, storage_for
from ..storage.location import local_path
from .output import Output, format_metrics, human_bytes, iso_time, table
from .reader import CheckpointReader, open_reader

_ORBAX_TMP = ".orbax-checkpoint-tmp"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("ls", parents=[common], help="list the checkpoints under a directory")
    p.add_argument("dir", help="a directory (or object-store prefix) of checkpoints")
    p.set_defaults(run=run)


def _orbax_entry(root: CheckpointRoot, name: str) -> dict[str, Any] | None:
    """State, time and size of an Orbax checkpoint at entry `name`; None when it is not one.
    TensorStore is asked only where Orbax's metadata files are there: where it has no
    credentials it waits long, and its client logs at every try."""
    location = f"{root.url.rstrip('/')}/{name}"
    local = local_path(location)
    if local is not None and not looks_like_orbax(local):
        return None
    if local is None:
        with root.child(name) as child:
            if not holds_orbax_markers(child):
                return None
    try:
        from ..orbax.reader import step_info
    except ImportError:  # without TensorStore, only local Orbax steps are recognised
        found, when = local is not None, None
    else:
        found, when = step_info(location)
    if not found:
        return None
    size = None
    if local is not None:
        size = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(local) for f in files
        )
    # Orbax saves into '<step>.orbax-checkpoint-tmp-<n>' and renames it when committed.
    done = when is not None and _ORBAX_TMP not in location.rstrip("/").rsplit("/", 1)[-1]
    state = "complete" if done else "incomplete"
    return {"format": "orbax", "state": state, "time_unix": when, "bytes": size}


def _entry(root: CheckpointRoot, name: str, committed: bool) -> dict[str, Any] | None:
    """The row of entry `name` (None: a checkpoint deleted since it was listed)."""
    entry: dict[str, Any] = {"name": name, "step": int(name) if name.isdigit() else None}
    if committed:
        child = root.child(name)
        try:
            m = read_summary(child)
        except CheckpointNotFoundError:  # (a writer's retention, beside this listing)
            return None
        except SnapshardError as e:
            return {
                **entry, "format": "snapshard", "state": "unreadable", "time_unix": None,
                "bytes": None, "error": str(e),
            }  # fmt: skip
        finally:
            child.close()
        with root.child(name) as step:
            retained = step.is_retained()
        return {
            **entry,
            "format": "snapshard",
            # retained: no step any more, its files kept for the references of others
            "state": "retained" if retained else "complete",
            "time_unix": m.created_unix,
            "bytes": m.total_bytes,
            "metrics": m.extra.get("metrics"),
        }
    orbax = _orbax_entry(root, name)
    if orbax is not None:
        return {**entry, **orbax}
    return {**entry, **_uncommitted(root, name)}


def _uncommitted(root: CheckpointRoot, name: str) -> dict[str, Any]:
    """What an entry without a committed manifest is: an unfinished save (its staging
    directory, or a checkpoint's own folders without the manifest), a directory of
    checkpoints (a run: listed with its number of steps and the newest), or something
    that is not snapshard's at all."""
    none: dict[str, Any] = {"time_unix": None, "bytes": None}
    location = f"{root.url.rstrip('/')}/{name}"
    local = local_path(location)
    if local is not None and not os.path.isdir(local):
        return {"format": "snapshard", "state": "incomplete", **none}  # only a staging directory
    inner = root_for(location).list()
    if DATA_DIR in inner or INDEX_DIR in inner:
        return {"format": "snapshard", "state": "incomplete", **none}
    steps = sorted((n for n, done in inner.items() if done), key=step_order)
    if steps:
        return {
            "format": "snapshard",
            "state": "run",
            "checkpoints": len(steps),
            "latest": steps[-1],
            **none,
        }
    return {"format": None, "state": "other", **none}


def list_checkpoints(location: str) -> dict[str, Any]:
    with storage_for(location) as storage:
        if storage.is_committed():
            raise SnapshardError(
                f"{storage.url} is a checkpoint, not a directory of checkpoints "
                f"(see: snapshard info {location})"
            )
    local = local_path(location)
    if local is not None and not os.path.isdir(local):
        raise CheckpointNotFoundError(f"no directory at {location}")
    root = root_for(location)
    found = root.list()
    rows = (_entry(root, name, found[name]) for name in sorted(found, key=step_order))
    entries = [e for e in rows if e is not None]
    unfinished = _unfinished(local)
    for e in entries:
        e["time"] = iso_time(e.get("time_unix"))
        if e["name"] in unfinished:
            e["unfinished"] = unfinished[e["name"]]
    return {"root": root.url, "checkpoints": entries}


def _unfinished(local: str | None) -> dict[str, list[dict[str, Any]]]:
    """By checkpoint name, the directories unfinished saves left beside it (local
    directories only), each with its writers, whether they run, and its size."""
    if local is None:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for u in stale_staging.find(Path(os.path.abspath(local))):
        out.setdefault(u.checkpoint, []).append(u.to_json())
    return out


def _unfinished_cell(e: dict[str, Any]) -> str:
    """The text column of an entry's unfinished saves:
    'name (writers gone: pid 7 on host1, 1.0 MiB)'."""
    parts = []
    for u in e.get("unfinished", ()):
        who = ", ".join(f"pid {o['pid']} on {o['host']}" for o in u["owners"]) or "none recorded"
        parts.append(f"{u['name']} (writers {u['state']}: {who}, {human_bytes(u['bytes'])})")
    return "; ".join(parts) or "-"


def run(args: argparse.Namespace, out: Output) -> int:
    doc = list_checkpoints(args.dir)

    def state(e: dict[str, Any]) -> str:
        if e["state"] == "run":
            return f"run ({e['checkpoints']} checkpoints, latest {e['latest']})"
        return str(e["state"])

    def text() -> str:
        entries = doc["checkpoints"]
        if not entries:
            return f"{doc['root']}: no checkpoints"
        with_metrics = any(e.get("metrics") for e in entries)
        with_unfinished = any(e.get("unfinished") for e in entries)
        rows = [
            [
                e["name"],
                state(e),
                e["format"] or "-",
                e["time"] or "-",
                human_bytes(e.get("bytes")),
                *([format_metrics(e.get("metrics")) or "-"] if with_metrics else []),
                *([_unfinished_cell(e)] if with_unfinished else []),
            ]
            for e in entries
        ]
        header = ["NAME", "STATE", "FORMAT", "TIME (UTC)", "SIZE"]
        header += ["METRICS"] * with_metrics + ["UNFINISHED SAVES"] * with_unfinished
        lines = [table(header, rows)]
        gone = [u for e in entries for u in e.get("unfinished", ()) if u["state"] == "gone"]
        if gone:  # an action only where there is one to take
            size = human_bytes(sum(u["bytes"] for u in gone))
            lines.append(
                f"{len(gone)} left by killed saves ({size}): `snapshard clean {args.dir}` "
                "shows them, --yes removes them"
            )
        return "\n".join(lines)

    out.result(doc, text)
    return 0


def open_for_command(location: str, command: str) -> CheckpointReader:
    """open_reader, but a directory of checkpoints (a run) is told apart from a missing
    checkpoint: the error names its newest step and the command to run on it."""
    try:
        return open_reader(location)
    except CheckpointNotFoundError as e:
        hint = _run_hint(location, command)
        if hint is None:
            raise
        raise CheckpointNotFoundError(f"{e}; {hint}") from None


def _run_hint(location: str, command: str) -> str | None:
    local = local_path(location)
    if local is not None and not os.path.isdir(local):
        return None
    try:
        found = root_for(location).list()
    except (SnapshardError, OSError, ValueError):
        return None
    steps = sorted((n for n, done in found.items() if done), key=step_order)
    if not steps:
        return None
    child = f"{location.rstrip('/')}/{steps[-1]}"
    return (
        f"it is a directory of {len(steps)} checkpoint(s), newest {steps[-1]!r}: "
        f"run `snapshard {command} {child}` (`snapshard ls {location}` lists them)"
    )
