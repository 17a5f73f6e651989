"""Who writes which box: a pure, deterministic function of the layouts.

Every process runs it over the same metadata and gets the same plan, so no process has to
ask another who writes what. Modes:

- ``single_replica``: of the copies of each unique shard, the one holding replica 0 writes it.
- ``replica_parallel``: the R processes holding copies of a shard each write one band of it.
  Bands are cut along the first axis with at least R rows (the outermost such axis, so a
  band is contiguous in C order), differ by at most one row, and shards smaller than
  ``min_band_bytes`` stay whole.
- ``balanced``: whole shards; each goes to the holder with the fewest bytes so far, largest
  shards first (a deterministic greedy over the shared metadata).
- ``auto`` (default): ``balanced`` when it is within 5% of perfectly even, else whichever of
  ``balanced`` and ``replica_parallel`` has the smaller maximum per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np

from .layout import ArrayLayout, ShardGroups

Mode = Literal["auto", "single_replica", "replica_parallel", "balanced"]
MODES: tuple[str, ...] = ("auto", "single_replica", "replica_parallel", "balanced")
DEFAULT_MIN_BAND_BYTES = 1 << 20
AUTO_BALANCE_TOLERANCE = 1.05


@dataclass(frozen=True, eq=False)
class ArrayWritePlan:
    """The boxes written for one array, with their writer and the device row they come from."""

    starts: np.ndarray  # (K, ndim)
    stops: np.ndarray  # (K, ndim)
    writer: np.ndarray  # (K,) process id
    source_row: np.ndarray  # (K,) layout row (a device of the writer) holding the box
    nbytes: np.ndarray  # (K,)


@dataclass(frozen=True, eq=False)
class WritePlan:
    mode: str
    arrays: tuple[ArrayWritePlan, ...]
    num_processes: int

    def bytes_per_process(self) -> np.ndarray:
        total = np.zeros(self.num_processes, dtype=np.int64)
        for a in self.arrays:
            np.add.at(total, a.writer, a.nbytes)
        return total

    def imbalance(self) -> float:
        """max / mean bytes written per process (1.0 is perfectly even)."""
        b = self.bytes_per_process()
        mean = b.mean() if len(b) else 0.0
        return float(b.max() / mean) if mean > 0 else 1.0

    def items_of(self, process: int) -> list[tuple[int, int]]:
        """(array index, item index) of every box `process` writes, in plan order."""
        out: list[tuple[int, int]] = []
        for i, a in enumerate(self.arrays):
            out.extend((i, int(k)) for k in np.flatnonzero(a.writer == process))
        return out


def _whole(sg: ShardGroups, choice: np.ndarray) -> ArrayWritePlan:
    """Every unique box written whole by candidate index `choice[u]` of box u."""
    idx = sg.cand_ptr[:-1] + choice
    return ArrayWritePlan(
        starts=sg.starts,
        stops=sg.stops,
        writer=sg.cand_process[idx],
        source_row=sg.cand_row[idx],
        nbytes=sg.nbytes,
    )


def plan_single_replica(layout: ArrayLayout) -> ArrayWritePlan:
    key = ("single_replica",)
    if key not in layout._cache:
        sg = layout.shards
        layout._cache[key] = _whole(sg, np.zeros(sg.count, dtype=np.int64))
    return layout._cache[key]  # type: ignore[return-value]


def band_bounds(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) cut into n bands whose lengths differ by at most one."""
    extent = stop - start
    return [(start + (j * extent) // n, start + ((j + 1) * extent) // n) for j in range(n)]


def plan_replica_parallel(layout: ArrayLayout, min_band_bytes: int) -> ArrayWritePlan:
    key = ("replica_parallel", min_band_bytes)
    cached = layout._cache.get(key)
    if cached is not None:
        return cached  # type: ignore[return-value]
    sg = layout.shards
    ncand = sg.num_candidates
    split = (ncand > 1) & (sg.nbytes >= min_band_bytes) & (layout.ndim > 0)
    if not split.any():
        plan = plan_single_replica(layout)
    else:
        starts, stops, writer, rows, nbytes = [], [], [], [], []
        for u in range(sg.count):
            lo = int(sg.cand_ptr[u])
            s, e = sg.starts[u], sg.stops[u]
            if not split[u]:
                starts.append(s)
                stops.append(e)
                writer.append(sg.cand_process[lo])
                rows.append(sg.cand_row[lo])
                nbytes.append(sg.nbytes[u])
                continue
            r = int(ncand[u])
            ext = e - s
            fits = np.flatnonzero(ext >= r)
            axis = int(fits[0]) if len(fits) else int(np.argmax(ext))
            n = min(r, int(ext[axis]))
            row_bytes = int(sg.nbytes[u]) // max(int(ext[axis]), 1)
            for j, (b0, b1) in enumerate(band_bounds(int(s[axis]), int(e[axis]), n)):
                bs, be = s.copy(), e.copy()
                bs[axis], be[axis] = b0, b1
                starts.append(bs)
                stops.append(be)
                writer.append(sg.cand_process[lo + j])
                rows.append(sg.cand_row[lo + j])
                nbytes.append((b1 - b0) * row_bytes)
        plan = ArrayWritePlan(
            starts=np.asarray(starts, dtype=np.int64).reshape(-1, layout.ndim),
            stops=np.asarray(stops, dtype=np.int64).reshape(-1, layout.ndim),
            writer=np.asarray(writer, dtype=np.int64),
            source_row=np.asarray(rows, dtype=np.int64),
            nbytes=np.asarray(nbytes, dtype=np.int64),
        )
    layout._cache[key] = plan
    return plan


@dataclass(frozen=True, eq=False)
class _CandidateGroups:
    """Boxes with several holders, grouped by identical holder sets (when those sets are disjoint).

    ``cands`` is (G, R) processes, ``boxes`` is (G, g) box indices sorted by size, largest first.
    None when the holder sets of the layout overlap without being equal (rare meshes): the
    planner then falls back to box-by-box greedy.
    """

    cands_idx: list[np.ndarray]  # per (R, g) bucket: (G, R) candidate positions in cand arrays
    boxes: list[np.ndarray]  # per bucket: (G, g)


def _candidate_groups(sg: ShardGroups, layout: ArrayLayout) -> _CandidateGroups | None:
    key = ("candidate_groups",)
    if key in layout._cache:
        return layout._cache[key]  # type: ignore[return-value]
    ncand = sg.num_candidates
    multi = np.flatnonzero(ncand > 1)
    by_set: dict[tuple[int, ...], list[int]] = {}
    for u in multi:
        lo, hi = sg.cand_ptr[u], sg.cand_ptr[u + 1]
        by_set.setdefault(tuple(sg.cand_process[lo:hi].tolist()), []).append(int(u))
    members = [p for s in by_set for p in s]
    result: _CandidateGroups | None
    if len(members) != len(set(members)):
        result = None
    else:
        buckets: dict[tuple[int, int], tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for boxes in by_set.values():
            u0 = boxes[0]
            r = int(ncand[u0])
            order = sorted(boxes, key=lambda u: (-int(sg.nbytes[u]), u))
            pos = np.arange(sg.cand_ptr[u0], sg.cand_ptr[u0] + r)
            # Candidate *positions* are per box; boxes of one group share the same processes,
            # in the same order, so the first box's positions stand for the group's processes.
            c, b = buckets.setdefault((r, len(order)), ([], []))
            c.append(pos)
            b.append(np.asarray(order, dtype=np.int64))
        result = _CandidateGroups(
            cands_idx=[np.stack(c) for c, _ in buckets.values()],
            boxes=[np.stack(b) for _, b in buckets.values()],
        )
    layout._cache[key] = result
    return result


def _assign_balanced(layout: ArrayLayout, load: np.ndarray) -> ArrayWritePlan:
    sg = layout.shards
    choice = np.zeros(sg.count, dtype=np.int64)
    ncand = sg.num_candidates
    single = np.flatnonzero(ncand == 1)
    np.add.at(load, sg.cand_process[sg.cand_ptr[single]], sg.nbytes[single])
    groups = _candidate_groups(sg, layout)
    if groups is None:
        for u in np.flatnonzero(ncand > 1)[np.argsort(-sg.nbytes[ncand > 1], kind="stable")]:
            lo, hi = sg.cand_ptr[u], sg.cand_ptr[u + 1]
            j = int(np.argmin(load[sg.cand_process[lo:hi]]))
            choice[u] = j
            load[sg.cand_process[lo + j]] += sg.nbytes[u]
    else:
        for pos, boxes in zip(groups.cands_idx, groups.boxes, strict=True):
            procs = sg.cand_process[pos]  # (G, R)
            cur = load[procs]
            rows = np.arange(len(procs))
            for j in range(boxes.shape[1]):
                pick = np.argmin(cur, axis=1)
                u = boxes[:, j]
                # Boxes of one group may list the same processes in another replica order.
                picked = procs[rows, pick]
                lo = sg.cand_ptr[u]
                r = procs.shape[1]
                box_procs = sg.cand_process[lo[:, None] + np.arange(r)]
                choice[u] = np.argmax(box_procs == picked[:, None], axis=1)
                cur[rows, pick] += sg.nbytes[u]
            load[procs] = cur
    return _whole(sg, choice)


def plan_balanced(layouts: Sequence[ArrayLayout], num_processes: int) -> list[ArrayWritePlan]:
    load = np.zeros(num_processes, dtype=np.int64)
    out: list[ArrayWritePlan | None] = [None] * len(layouts)
    # Largest shards first: the greedy is then within 4/3 of optimal (LPT).
    biggest = [int(la.shards.nbytes.max()) if la.shards.count else 0 for la in layouts]
    for i in sorted(range(len(layouts)), key=lambda i: (-biggest[i], i)):
        out[i] = _assign_balanced(layouts[i], load)
    return out  # type: ignore[return-value]


def plan_writes(
    layouts: Sequence[ArrayLayout],
    mode: str = "auto",
    *,
    num_processes: int | None = None,
    min_band_bytes: int = DEFAULT_MIN_BAND_BYTES,
) -> WritePlan:
    """The write plan of a whole tree. Pure and deterministic; cached for repeated layouts."""
    if mode not in MODES:
        raise ValueError(f"unknown write mode {mode!r}; expected one of {', '.join(MODES)}")
    if num_processes is None:
        num_processes = max((int(la.process_ids.max()) for la in layouts), default=0) + 1
    return _plan_cached(tuple(layouts), mode, num_processes, min_band_bytes)


@lru_cache(maxsize=8)
def _plan_cached(
    layouts: tuple[ArrayLayout, ...], mode: str, num_processes: int, min_band_bytes: int
) -> WritePlan:
    if mode == "single_replica":
        return WritePlan(mode, tuple(plan_single_replica(la) for la in layouts), num_processes)
    if mode == "replica_parallel":
        plans = tuple(plan_replica_parallel(la, min_band_bytes) for la in layouts)
        return WritePlan(mode, plans, num_processes)
    balanced = WritePlan("balanced", tuple(plan_balanced(layouts, num_processes)), num_processes)
    if mode == "balanced" or balanced.imbalance() <= AUTO_BALANCE_TOLERANCE:
        return balanced
    banded = _plan_cached(layouts, "replica_parallel", num_processes, min_band_bytes)
    if banded.bytes_per_process().max() < balanced.bytes_per_process().max():
        return banded
    return balanced
