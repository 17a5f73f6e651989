"""The committed steps of a manager's directory, the same on every process of a job.

Steps are checkpoints named by their number (`DIR/100`). Incomplete steps are never listed,
and every process of a job holds the listing process 0 made: process 0 lists the directory
(after a writer's start-up, writer.py) and publishes the listing with its outcome in one
rendezvous, which the others take. Steps retained for references (references.py) are listed
apart, for retention.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..coordination import Coordinator
from ..coordination.rendezvous import Rendezvous, namespace
from ..errors import CheckpointNotFoundError
from ..format.reading import read_summary
from ..storage import CheckpointRoot
from .policies import KeepBest, StepInfo


class StepListing:
    """The committed steps of one directory as every process holds them, and the queries on
    them. The CheckpointManager (manager.py) is one that saves (writer.py) and restores; its
    save's thread adds and drops steps, under `_lock`."""

    def __init__(
        self, root: CheckpointRoot, coord: Coordinator, timeout_s: float, best: KeepBest | None
    ):
        """`timeout_s` bounds the rendezvous of a listing; `best` ranks `best_step`."""
        self._root = root
        self._coord = coord
        self._timeout_s = timeout_s
        self._best = best
        self._lock = threading.Lock()
        self._steps: dict[int, StepInfo] = {}
        self._retained: set[str] = set()

    def _agreed_steps(
        self,
        kind: str,
        what: str,
        act: Callable[[], None] | None = None,
        tidy: Callable[[dict[int, StepInfo], set[str]], None] | None = None,
    ) -> dict[int, StepInfo]:
        """The committed steps as process 0 lists them (after `act`, when given; `tidy`
        given the listing may remove retained steps from it first); the others take its
        listing with its outcome, so every process of a job holds the same steps even while
        another job commits and deletes, and learns of a failure. Sets the steps retained
        for references too."""
        rv = Rendezvous(
            self._coord,
            namespace(kind, self._root.url),
            f"{what} on {self._root.url}",
            self._timeout_s,
        )
        rv.start_clock()
        if not self._coord.is_leader:
            doc = rv.await_outcome()
            self._retained = set(doc["retained"])
            return {d["step"]: StepInfo(d["step"], d["metrics"], d["time"]) for d in doc["steps"]}
        try:
            if act is not None:
                act()
            steps, self._retained = self._scan()
            if tidy is not None:
                tidy(steps, self._retained)
        except BaseException as e:
            rv.publish_outcome(e)
            raise
        listing = [{"step": i.step, "metrics": i.metrics, "time": i.time} for i in steps.values()]
        rv.publish_outcome(steps=listing, retained=sorted(self._retained))
        return steps

    def _scan(self) -> tuple[dict[int, StepInfo], set[str]]:
        """The committed steps under the root, and the steps retained for references. A
        step deleted between the listing and the reading of its manifest (by a writer
        beside this reader) is not listed: a listing never shows a step being deleted or
        committed (both are one rename, or the commit marker, on the stores)."""
        steps, retained = {}, set()
        for name, committed in self._root.list().items():
            if not (committed and name.isdigit()):
                continue
            try:
                with self._root.child(name) as storage:
                    if storage.is_retained():
                        retained.add(name)
                        continue
                    summary = read_summary(storage)
            except CheckpointNotFoundError:
                continue  # deleted meanwhile
            metrics = summary.extra.get("metrics")
            steps[int(name)] = StepInfo(int(name), metrics, summary.created_unix)
        return steps, retained

    @property
    def directory(self) -> str:
        return self._root.url

    def all_steps(self) -> list[int]:
        """Committed steps, ascending. Incomplete saves are never listed."""
        with self._lock:
            return sorted(self._steps)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best committed step by the retention's KeepBest, or None without one or metrics."""
        if self._best is None:
            return None
        with self._lock:
            ranked = self._best.rank(sorted(self._steps.values(), key=lambda s: s.step))
        return ranked[0].step if ranked else None

    def metrics(self, step: int) -> Mapping[str, Any] | None:
        with self._lock:
            return self._steps[step].metrics


def steps_text(steps: list[int]) -> str:
    """A listing of steps for a message: all of few, the ends of many."""
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}"
