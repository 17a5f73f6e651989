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
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from .layout import ArrayLayout, ShardGroups, unique_rows

MODES: tuple[str, ...] = ("auto", "single_replica", "replica_parallel", "balanced")
DEFAULT_MIN_BAND_BYTES = 1 << 20
AUTO_BALANCE_TOLERANCE = 1.05


class ArrayWritePlan:
    """The boxes written for one array, with their writer and the device row they come from.

    Item k is written by candidate `cand[k]` of the layout's ShardGroups: process
    `writer[k]` copies it from layout row `source_row[k]`. Both are derived on first use, so
    a plan of thousands of arrays does not materialise them unless asked.
    """

    def __init__(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        nbytes: np.ndarray,
        groups: ShardGroups,
        cand: np.ndarray,
    ):
        self.starts, self.stops, self.nbytes = starts, stops, nbytes  # (K, ndim), (K, ndim), (K,)
        self.groups = groups
        self.cand = cand  # (K,) index into groups.cand_process / cand_row
        self.whole_boxes = starts is groups.starts  # item k is box k of the groups

    @cached_property
    def writer(self) -> np.ndarray:
        return self.groups.cand_process[self.cand]

    @cached_property
    def source_row(self) -> np.ndarray:
        return self.groups.cand_row[self.cand]

    @cached_property
    def digest(self) -> int:
        """crc32c of who writes which box: equal on every process that planned alike (a
        save of differing trees compares the plans of the processes holding one array)."""
        import crc32c  # (the planner itself needs no checksums)

        parts = (self.writer.astype(np.int64), self.starts, self.stops)
        return int(crc32c.crc32c(b"".join(np.ascontiguousarray(p).tobytes() for p in parts)))

    def items_of(self, process: int) -> np.ndarray:
        """Indices of the items `process` writes, ascending."""
        if not self.whole_boxes:
            return np.flatnonzero(self.writer == process)
        pos = self.groups.candidates_of(process)  # the boxes `process` holds: few
        return np.sort(self.groups.cand_box[pos][self.cand[self.groups.cand_box[pos]] == pos])


@dataclass(frozen=True, eq=False)
class WritePlan:
    """Who writes what in one save: one ArrayWritePlan per array, computed alike on every
    process from the layouts alone. `mode` is the ownership rule that made it
    ("single_replica", "replica_parallel" or "balanced"; see `plan`), `load` the bytes each
    process writes where the planner counted them."""

    mode: str
    arrays: tuple[ArrayWritePlan, ...]
    num_processes: int
    load: np.ndarray | None = None  # bytes per process, when the planner counted them
    _items: dict[int, ProcessItems] = field(default_factory=dict, compare=False, repr=False)

    def bytes_per_process(self) -> np.ndarray:
        if self.load is not None:
            return self.load
        total = np.zeros(self.num_processes, dtype=np.int64)
        for a in self.arrays:
            total += np.bincount(a.writer, weights=a.nbytes, minlength=self.num_processes).astype(
                np.int64
            )
        return total

    def imbalance(self) -> float:
        """max / mean bytes written per process (1.0 is perfectly even)."""
        b = self.bytes_per_process()
        mean = b.mean() if len(b) else 0.0
        return float(b.max() / mean) if mean > 0 else 1.0

    def process_items(self, process: int) -> ProcessItems:
        """The items of `process` that hold bytes, in plan order, as columns; computed
        once per plan (a save of the same layouts reuses its plan) and for all arrays of
        one layout at once."""
        found = self._items.get(process)
        if found is None:
            found = self._items[process] = _process_items(self.arrays, process)
        return found


@dataclass(frozen=True)
class ProcessItems:
    """The items one process writes, in plan order (by array, then item), as columns: the
    array of each (index into WritePlan.arrays), its item number in that array's plan, its
    bytes, and the layout row it is copied from. Items without bytes are left out."""

    array: np.ndarray
    item: np.ndarray
    nbytes: np.ndarray
    source_row: np.ndarray

    def __len__(self) -> int:
        return len(self.array)


# Arrays of one layout are matched against its boxes this many (array, box) pairs at a time.
_MATCH_CELLS = 1 << 22


def _process_items(arrays: Sequence[ArrayWritePlan], process: int) -> ProcessItems:
    cols: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    alike: dict[int, list[int]] = {}  # id(groups): arrays written box by box from them
    for i, a in enumerate(arrays):
        if a.whole_boxes:
            alike.setdefault(id(a.groups), []).append(i)
            continue
        ks = a.items_of(process)
        cols.append((np.full(len(ks), i, np.int64), ks, a.nbytes[ks], a.source_row[ks]))
    for members in alike.values():
        sg = arrays[members[0]].groups
        pos = sg.candidates_of(process)  # the boxes `process` holds, in candidate order
        if not len(pos):
            continue
        boxes = sg.cand_box[pos]
        by_box = np.argsort(boxes, kind="stable")
        boxes, pos = boxes[by_box], pos[by_box]
        step = max(1, _MATCH_CELLS // len(boxes))
        for lo in range(0, len(members), step):
            part = np.asarray(members[lo : lo + step], np.int64)
            cand = np.stack([arrays[i].cand for i in part.tolist()])
            # Item k of an array is box k; this process writes it where it was chosen.
            which, col = np.nonzero(cand[:, boxes] == pos)
            cols.append((part[which], boxes[col], sg.nbytes[boxes[col]], sg.cand_row[pos[col]]))
    if not cols:
        empty = np.zeros(0, np.int64)
        return ProcessItems(empty, empty, empty, empty)
    array, item, nbytes, row = (np.concatenate(c) for c in zip(*cols, strict=True))
    keep = np.flatnonzero(nbytes)
    order = keep[np.lexsort((item[keep], array[keep]))]
    return ProcessItems(array[order], item[order], nbytes[order], row[order])


def plan_single_replica(layout: ArrayLayout) -> ArrayWritePlan:
    memo = layout.memo
    if memo.single_replica is None:
        sg = layout.shards
        # Every unique box written whole by its candidate 0 (the holder of replica 0).
        memo.single_replica = ArrayWritePlan(
            sg.starts, sg.stops, sg.nbytes, sg, sg.cand_ptr[:-1].copy()
        )
    plan: ArrayWritePlan = memo.single_replica
    return plan


def plan_replica_parallel(layout: ArrayLayout, min_band_bytes: int) -> ArrayWritePlan:
    cached: ArrayWritePlan | None = layout.memo.replica_parallel.get(min_band_bytes)
    if cached is not None:
        return cached
    sg = layout.shards
    ncand = sg.num_candidates
    split = (ncand > 1) & (sg.nbytes >= min_band_bytes) & (layout.ndim > 0)
    if not split.any():
        plan = plan_single_replica(layout)
    else:
        ext = sg.stops - sg.starts
        fits = ext >= ncand[:, None]
        # The first axis with at least R rows (outermost: bands stay contiguous), else the longest.
        axis = np.where(fits.any(axis=1), np.argmax(fits, axis=1), np.argmax(ext, axis=1))
        u_ext = ext[np.arange(sg.count), axis]
        bands = np.where(split, np.minimum(ncand, u_ext), 1)
        u = np.repeat(np.arange(sg.count), bands)  # the box of each item
        j = np.arange(len(u)) - np.repeat(np.cumsum(bands) - bands, bands)  # band number
        n, a, e_u = bands[u], axis[u], u_ext[u]
        base = sg.starts[u, a]
        b0, b1 = base + (j * e_u) // n, base + ((j + 1) * e_u) // n
        starts, stops = sg.starts[u].copy(), sg.stops[u].copy()
        rows = np.arange(len(u))
        starts[rows, a], stops[rows, a] = b0, b1
        row_bytes = sg.nbytes[u] // np.maximum(e_u, 1)
        nbytes = np.where(split[u], (b1 - b0) * row_bytes, sg.nbytes[u])
        plan = ArrayWritePlan(starts, stops, nbytes, sg, sg.cand_ptr[u] + j)
    layout.memo.replica_parallel[min_band_bytes] = plan
    return plan


@dataclass(frozen=True, eq=False)
class _Bucket:
    """Groups of boxes that share one holder set, all groups with R holders and g boxes.

    procs (G, R): each group's holders (sorted); boxes (G, g): its boxes, largest first;
    rank (G, g, R): where holder procs[:, r] stands in each box's own candidate list."""

    procs: np.ndarray
    boxes: np.ndarray
    rank: np.ndarray


def _holder_groups(layout: ArrayLayout) -> list[_Bucket] | None:
    """The boxes with several holders, grouped by identical holder sets, or None when two
    different holder sets share a process (rare meshes: the planner then goes box by box)."""
    memo = layout.memo
    if memo.holder_groups_known:
        known: list[_Bucket] | None = memo.holder_groups
        return known
    sg = layout.shards
    ncand = sg.num_candidates
    multi = np.flatnonzero(ncand > 1)
    buckets: list[_Bucket] = []
    members = []
    for r in np.unique(ncand[multi]).tolist():
        us = multi[ncand[multi] == r]
        box_procs = sg.cand_process[sg.cand_ptr[us][:, None] + np.arange(r)]
        by_process = np.argsort(box_procs, axis=1)  # box's list position of its i-th smallest
        sets, set_of_box = unique_rows(np.take_along_axis(box_procs, by_process, axis=1))
        members.append(sets.reshape(-1))
        order = np.lexsort((us, -sg.nbytes[us], set_of_box))
        counts = np.bincount(set_of_box, minlength=len(sets))
        start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        for g in np.unique(counts).tolist():
            which = np.flatnonzero(counts == g)
            pos = order[start[which][:, None] + np.arange(g)]  # (G, g) into us
            buckets.append(_Bucket(sets[which], us[pos], by_process[pos]))
    flat = np.concatenate(members) if members else np.zeros(0, np.int64)
    result = buckets if len(np.unique(flat)) == len(flat) else None
    memo.holder_groups, memo.holder_groups_known = result, True
    return result


def _assign_layout(
    layout: ArrayLayout, count: int, load: np.ndarray, forced: np.ndarray
) -> np.ndarray:
    """Choices (count, boxes) for `count` arrays sharing `layout`: candidate index per box.

    Boxes with one holder go to it. The k·g boxes of a holder group (k arrays, g boxes each)
    go one by one to the least loaded of its holders, for all groups at once: holder groups
    are disjoint, so every group's greedy runs in the same vector operation."""
    sg = layout.shards
    choice = np.zeros((count, sg.count), dtype=np.int32)
    single = np.flatnonzero(sg.num_candidates == 1)
    np.add.at(load, sg.cand_process[sg.cand_ptr[single]], sg.nbytes[single] * count)
    np.add.at(forced, sg.cand_process[sg.cand_ptr[single]], sg.nbytes[single] * count)
    buckets = _holder_groups(layout)
    if buckets is None:
        multi = np.flatnonzero(sg.num_candidates > 1)
        multi = multi[np.argsort(-sg.nbytes[multi], kind="stable")]
        for k in range(count):
            for u in multi:
                lo, hi = sg.cand_ptr[u], sg.cand_ptr[u + 1]
                j = int(np.argmin(load[sg.cand_process[lo:hi]]))
                choice[k, u] = j
                load[sg.cand_process[lo + j]] += sg.nbytes[u]
        return choice
    for b in buckets:
        n_groups = b.procs.shape[0]
        g = b.boxes.shape[1]
        cur = load[b.procs]  # (G, R)
        sizes = sg.nbytes[b.boxes]  # (G, g)
        holder = np.empty((count, n_groups, g), dtype=np.int64)  # position in b.procs
        rows = np.arange(n_groups)
        for k in range(count):
            for j in range(g):
                pick = np.argmin(cur, axis=1)
                holder[k, :, j] = pick
                cur[rows, pick] += sizes[:, j]
        load[b.procs] = cur
        # The holder's position in each box's own candidate list.
        which = b.rank[rows[None, :, None], np.arange(g)[None, None, :], holder]  # (k, G, g)
        choice[:, b.boxes.reshape(-1)] = which.reshape(count, -1)
    return choice


def plan_balanced(
    layouts: Sequence[ArrayLayout], num_processes: int
) -> tuple[list[ArrayWritePlan], np.ndarray, np.ndarray]:
    """Balanced plans of every array, the bytes each process writes, and the bytes that could
    go nowhere else (boxes with a single holder) per process."""
    load = np.zeros(num_processes, dtype=np.int64)
    forced = np.zeros(num_processes, dtype=np.int64)
    out: list[ArrayWritePlan | None] = [None] * len(layouts)
    by_layout: dict[int, list[int]] = {}
    for i, la in enumerate(layouts):
        by_layout.setdefault(id(la), []).append(i)
    # Largest boxes first: the greedy is then within 4/3 of optimal (LPT).
    groups = sorted(
        by_layout.values(),
        key=lambda ix: (-int(layouts[ix[0]].shards.nbytes.max(initial=0)), ix[0]),
    )
    for ix in groups:
        la = layouts[ix[0]]
        sg = la.shards
        cand = _assign_layout(la, len(ix), load, forced)  # int32: plans of big jobs are large
        cand += sg.cand_ptr[:-1].astype(np.int32)
        for k, i in enumerate(ix):
            out[i] = ArrayWritePlan(sg.starts, sg.stops, sg.nbytes, sg, cand[k])
    return out, load, forced  # type: ignore[return-value]


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


# Plans of big jobs are large (one entry per chunk of every array): keep the last few only.
@lru_cache(maxsize=4)
def _plan_cached(
    layouts: tuple[ArrayLayout, ...], mode: str, num_processes: int, min_band_bytes: int
) -> WritePlan:
    if mode == "single_replica":
        return WritePlan(mode, tuple(plan_single_replica(la) for la in layouts), num_processes)
    if mode == "replica_parallel":
        banded = tuple(plan_replica_parallel(la, min_band_bytes) for la in layouts)
        return WritePlan(mode, banded, num_processes)
    whole, load, forced = plan_balanced(layouts, num_processes)
    balanced = WritePlan("balanced", tuple(whole), num_processes, load)
    if mode == "balanced":
        return balanced
    per_process = balanced.bytes_per_process()
    bound = max(int(forced.max(initial=0)), -(-int(per_process.sum()) // num_processes))
    if balanced.imbalance() <= AUTO_BALANCE_TOLERANCE or per_process.max() <= bound:
        return balanced  # even enough, or no plan could do better
    rp = _plan_cached(layouts, "replica_parallel", num_processes, min_band_bytes)
    return rp if rp.bytes_per_process().max() < per_process.max() else balanced


def plan_by_holders(
    layouts: Sequence[ArrayLayout],
    keys: Sequence[str],
    mode: str = "auto",
    *,
    num_processes: int,
    min_band_bytes: int = DEFAULT_MIN_BAND_BYTES,
) -> WritePlan:
    """The write plan of one process's tree where the processes' trees differ
    (SaveOptions.trees_differ): the arrays held by one set of processes are planned
    together, apart from the others, in the order of their `keys` (their paths as text).
    Every holder of an array
    passes every array of its holder set (a DTensor lives on every rank of its mesh), so
    each holder computes the same plan for them whatever else its own tree holds: the
    plan stays a pure function of what every holder sees, with no process asking another.
    """
    groups: dict[bytes, list[int]] = {}
    for i, la in enumerate(layouts):
        holders = la.memo.holders
        if holders is None:
            holders = la.memo.holders = np.unique(la.process_ids).tobytes()
        groups.setdefault(holders, []).append(i)
    arrays: list[ArrayWritePlan | None] = [None] * len(layouts)
    modes: set[str] = set()
    for ix in groups.values():
        ix.sort(key=lambda i: keys[i])
        part = plan_writes(
            [layouts[i] for i in ix], mode, num_processes=num_processes,
            min_band_bytes=min_band_bytes,
        )  # fmt: skip
        modes.add(part.mode)
        for i, a in zip(ix, part.arrays, strict=True):
            arrays[i] = a
    out_mode = modes.pop() if len(modes) == 1 else mode
    return WritePlan(out_mode, tuple(arrays), num_processes)  # type: ignore[arg-type]
