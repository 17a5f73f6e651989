"""Format 2.2: which of the manifest's leaves each process saved, where the processes' trees
differ (pipeline stages, expert groups: a save with `SaveOptions(trees_differ=True)`).

A process's record file (and values file) numbers the leaves of its own tree, in its own
order; the manifest's leaves are the union of every process's tree. The process table maps
one onto the other:

    "trees":   [[[first, count], ...], ...]  per distinct tree, the manifest index of each
                                             of its leaves in that tree's order, as runs of
                                             consecutive indices
    "tree_of": [[tree, count], ...]          the tree of every process in turn, as runs

A pipeline-parallel job of 10,000 processes with 8 stages stores 8 trees (a few runs each)
and a few runs of processes: the map stays small whatever the process count. Without the
two keys (format 2.1 and before) every process saved every leaf, in manifest order.

Pure: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .bounds import bounded_int

_MAX_RUNS = 1 << 24


def _runs(values: np.ndarray, step: int) -> list[list[int]]:
    """`values` as [first, count] runs of values each `step` above the last (0: equal)."""
    out: list[list[int]] = []
    for v in values.tolist():
        if out and v == out[-1][0] + step * out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _unrun(runs: Any, step: int, values: int, total: int, what: str, where: str) -> np.ndarray:
    """The values of `runs` (_runs), each below `values`, at most `total` of them."""
    if not isinstance(runs, list) or len(runs) > _MAX_RUNS:
        raise CorruptCheckpointError(f"{where}: malformed {what}")
    parts = []
    seen = 0
    for r in runs:
        if not (isinstance(r, list) and len(r) == 2):
            raise CorruptCheckpointError(f"{where}: malformed {what}")
        first = bounded_int(r[0], 0, values - 1, what, where)
        count = bounded_int(r[1], 1, total, what, where)
        seen += count
        if seen > total or first + step * (count - 1) >= values:
            raise CorruptCheckpointError(f"{where}: {what} runs past its bounds")
        parts.append(first + step * np.arange(count, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass
class LeafMap:
    """Per distinct tree, the manifest indices of its leaves in its own order (`trees`), and
    the tree of every process (`tree_of`)."""

    trees: list[np.ndarray]
    tree_of: np.ndarray
    _inverse: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def count(self, process: int) -> int:
        """How many leaves `process` saved (the leaf count of its record file)."""
        return len(self.trees[int(self.tree_of[process])])

    def local(self, process: int, leaves: np.ndarray, leaf_count: int) -> np.ndarray:
        """The indices in `process`'s own tree of manifest leaves `leaves` (-1: it has not
        saved that leaf); `leaf_count`: the manifest's."""
        t = int(self.tree_of[process])
        inv = self._inverse.get(t)
        if inv is None:
            inv = np.full(leaf_count, -1, np.int64)
            inv[self.trees[t]] = np.arange(len(self.trees[t]))
            self._inverse[t] = inv
        return inv[np.asarray(leaves, np.int64)]

    def to_json(self) -> dict[str, Any]:
        return {
            "trees": [_runs(t, 1) for t in self.trees],
            "tree_of": [[v, n] for v, n in _runs(self.tree_of, 0)],
        }

    @staticmethod
    def from_json(d: dict[str, Any], process_count: int, leaf_count: int, where: str) -> LeafMap:
        raw = d.get("trees")
        if not isinstance(raw, list) or not raw or len(raw) > process_count:
            raise CorruptCheckpointError(f"{where}: malformed tree list of the process table")
        trees = [_unrun(t, 1, leaf_count, leaf_count, "tree", where) for t in raw]
        for t in trees:
            if len(np.unique(t)) != len(t):
                raise CorruptCheckpointError(f"{where}: a tree lists one leaf twice")
        tree_of = _unrun(d.get("tree_of"), 0, len(trees), process_count, "tree_of", where)
        if len(tree_of) != process_count:
            raise CorruptCheckpointError(
                f"{where}: the process table's tree_of does not name a tree for each of "
                f"{process_count} processes"
            )
        return LeafMap(trees, tree_of)
