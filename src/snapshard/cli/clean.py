"""`snapshard clean DIR`: remove what killed saves left beside the checkpoints in DIR.

A save that was killed leaves its staging directory (`<checkpoint>.snapshard-tmp-<job>-<n>`)
full size. Each records the processes that wrote into it (storage/owner_records.py); the
ones whose writers are all provably gone are removed, after a dry run by default:

    snapshard clean DIR                 print what would be removed, and what stays and why
    snapshard clean DIR --yes           remove it
    snapshard clean DIR --yes --unknown also remove what no check can clear: staging
                                        directories of another host or without an owner
                                        record (an older version's), and checkpoints
                                        whose deletion stopped; only when no save to DIR runs

A directory whose writer is running is never removed. Every save into DIR removes the stale
ones itself; this command is for a directory no job saves into any more.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError, SnapshardError
from ..format.naming import MANIFEST_NAME
from ..storage import stale_staging
from ..storage.location import local_path
from ..storage.owner_records import ALIVE, GONE
from ..storage.stale_staging import Unfinished
from .output import Output, human_bytes, table


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "clean",
        parents=[common],
        help="remove the staging directories killed saves left (a dry run unless --yes)",
    )
    p.add_argument("dir", help="a local directory of checkpoints")
    p.add_argument("--yes", action="store_true", help="remove them (without it: a dry run)")
    p.add_argument(
        "--unknown",
        action="store_true",
        help="also remove those whose writers cannot be checked (another host, no owner "
        "record, a deletion that stopped): only when no save to DIR runs",
    )
    p.set_defaults(run=run)


def _directory(location: str) -> Path:
    """The local directory of checkpoints `location` names (a bad input error otherwise)."""
    local = local_path(location)
    if local is None:
        raise SnapshardError(
            f"{location}: snapshard clean works on local directories; on an object store a "
            "CheckpointManager removes unfinished saves when it becomes the writer (its first "
            "save, or its start with LeasePolicy(at_start=True))"
        )
    path = Path(os.path.abspath(local))
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no directory at {location}")
    if (path / MANIFEST_NAME).is_file():
        raise SnapshardError(
            f"{location} is a checkpoint; what its unfinished saves left lies beside it: "
            f"snapshard clean {path.parent}"
        )
    return path


def removable(u: Unfinished, unknown: bool) -> bool:
    """Whether `clean` removes `u`: its writers are gone, or (`unknown`) cannot be checked."""
    return u.state == GONE or (unknown and u.state != ALIVE)


def _remove(found: list[Unfinished]) -> list[str]:
    """Remove each directory (renamed aside first, so a writer that appeared meanwhile keeps
    it); the names of those that could not be removed, with why."""
    failed = []
    for u in found:
        try:
            trash = stale_staging.set_aside(u)
        except OSError as e:
            failed.append(f"{u.path.name}: {e}")
            continue
        if trash is None:
            failed.append(f"{u.path.name}: a writer started using it; left to it")
            continue
        stale_staging.delete(trash)
        if trash.exists():
            failed.append(f"{u.path.name}: not all of it could be deleted ({trash.name} remains)")
    return failed


def run(args: argparse.Namespace, out: Output) -> int:
    root = _directory(args.dir)
    found = stale_staging.find(root)
    chosen = [u for u in found if removable(u, args.unknown)]
    entries = [  # sizes taken before anything is removed
        {**u.to_json(), "action": "remove" if u in chosen else "keep"} for u in found
    ]
    failed = _remove(chosen) if args.yes else []
    doc = {"root": str(root), "dry_run": not args.yes, "entries": entries, "failed": failed}

    def text() -> str:
        if not found:
            return f"{root}: nothing left by unfinished saves"
        rows = [[e["name"], e["action"], e["state"], human_bytes(e["bytes"]), e["why"]]
                for e in entries]  # fmt: skip
        lines = [table(["NAME", "ACTION", "WRITERS", "SIZE", "WHY"], rows)]
        total = human_bytes(sum(e["bytes"] for e in entries if e["action"] == "remove"))
        if not chosen:
            lines.append("nothing to remove")
        elif args.yes:
            lines.append(f"removed {len(chosen) - len(failed)} of {len(chosen)} ({total})")
        else:
            lines.append(f"dry run: would remove {len(chosen)} ({total}); --yes removes them")
        if not args.unknown and any(e["state"] not in (ALIVE, GONE) for e in entries):
            lines.append(
                "--unknown also removes those whose writers cannot be checked, when no "
                "save to this directory runs"
            )
        lines.extend(f"could not remove {f}" for f in failed)
        return "\n".join(lines)

    out.result(doc, text)
    return 1 if failed else 0
