"""`snapshard ls DIR`: the checkpoints (a manager's steps) under a directory."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import CheckpointNotFoundError, SnapshardError
from ..format.reading import read_manifest
from ..interop import local_path, looks_like_orbax, step_order
from ..storage import CheckpointRoot, root_for, storage_for
from .output import Output, human_bytes, iso_time, table

_ORBAX_TMP = ".orbax-checkpoint-tmp"


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("ls", parents=[common], help="list the checkpoints under a directory")
    p.add_argument("dir", help="a directory (or object-store prefix) of checkpoints")
    p.set_defaults(run=run)


def _orbax_entry(location: str) -> dict[str, Any] | None:
    """State, time and size of an Orbax checkpoint at `location`; None when it is not one."""
    local = local_path(location)
    if local is not None and not looks_like_orbax(local):
        return None
    try:
        from ..interop.orbax import step_info
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


def _entry(root: CheckpointRoot, name: str, committed: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, "step": int(name) if name.isdigit() else None}
    if committed:
        child = root.child(name)
        try:
            m = read_manifest(child)
        except SnapshardError as e:
            return {**entry, "format": "snapshard", "state": "unreadable", "error": str(e)}
        finally:
            child.close()
        from ..manager.references import is_retained

        retained = is_retained(root.child(name))
        return {
            **entry,
            "format": "snapshard",
            # retained: no step any more, its files kept for the references of others
            "state": "retained" if retained else "complete",
            "time_unix": m.created_unix,
            "bytes": m.total_bytes,
        }
    orbax = _orbax_entry(f"{root.url.rstrip('/')}/{name}")
    if orbax is not None:
        return {**entry, **orbax}
    return {**entry, "format": None, "state": "incomplete", "time_unix": None, "bytes": None}


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
    entries = [_entry(root, name, found[name]) for name in sorted(found, key=step_order)]
    for e in entries:
        e["time"] = iso_time(e.get("time_unix"))
    return {"root": root.url, "checkpoints": entries}


def run(args: argparse.Namespace, out: Output) -> int:
    doc = list_checkpoints(args.dir)

    def text() -> str:
        rows = [
            [
                e["name"],
                e["state"],
                e["format"] or "-",
                e["time"] or "-",
                human_bytes(e.get("bytes")),
            ]
            for e in doc["checkpoints"]
        ]
        if not rows:
            return f"{doc['root']}: no checkpoints"
        return table(["NAME", "STATE", "FORMAT", "TIME (UTC)", "SIZE"], rows)

    out.result(doc, text)
    return 0
