"""A save that failed in its writer process, or whose writer died (writer_process.py): this
process finishes the writer's part of the commit protocol in its place (`finish_protocol`),
knowing from the writer's calls how far it got (`Seen`).
"""

from __future__ import annotations

import json
from typing import Any

from ..coordination.rendezvous import report_failure
from ..errors import SnapshardError
from ..format.reading import read_manifest
from .commit import discard_own
from .state import PreparedSave


class Seen:
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


def finish_protocol(
    prep: PreparedSave, error: BaseException, seen: Seen, *, died: bool = False
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
