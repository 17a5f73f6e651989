"""Sharding metadata of one array as plain data: where every device's box is and who holds it.

This is the planner's only input about an array. It is built by the framework adapter from
metadata every process already has (global shape, each device's index box, replica id and
process id), so every process builds the same layout with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unique rows of a 2-D integer array, sorted, and each row's index among them.

    The same as np.unique(a, axis=0, return_inverse=True), several times faster."""
    if len(a) == 0:
        return a.copy(), np.zeros(0, dtype=np.int64)
    order = np.lexsort(a.T[::-1])
    sorted_rows = a[order]
    new = np.ones(len(a), dtype=bool)
    new[1:] = np.any(sorted_rows[1:] != sorted_rows[:-1], axis=1)
    inverse = np.empty(len(a), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return sorted_rows[new], inverse


@dataclass
class LayoutMemo:
    """What the planner and the save work out from one layout, kept with it (layouts with
    the same shape and sharding are one object, so arrays alike share the work). Typed
    loosely: the types are the planner's and the save's, above this module."""

    single_replica: Any = None  # write_plan.ArrayWritePlan
    replica_parallel: dict[int, Any] = field(default_factory=dict)  # by min_band_bytes
    holder_groups: Any = None  # write_plan: (list of _Bucket, or None) once worked out
    holder_groups_known: bool = False
    digest: int | None = None  # saving: crc32c of where the boxes live
    description: Any = None  # saving: (format.layouts description, Mesh or None)
    holders: bytes | None = None  # write_plan.plan_by_holders: the holding processes
    own: bool = False  # own_layout: held by the saving process, whichever it is


@dataclass(eq=False)
class ArrayLayout:
    """One row per device: its box [starts, stops), its replica id and its process id.

    Layouts with the same shape and sharding should be the same object: the planner caches
    per-layout work on it (`memo`).
    """

    shape: tuple[int, ...]
    itemsize: int
    starts: np.ndarray  # int64 (devices, ndim)
    stops: np.ndarray  # int64 (devices, ndim)
    replica_ids: np.ndarray  # int64 (devices,)
    process_ids: np.ndarray  # int64 (devices,)
    memo: LayoutMemo = field(default_factory=LayoutMemo, repr=False)

    def __post_init__(self) -> None:
        nd = len(self.shape)
        self.replica_ids = np.asarray(self.replica_ids, dtype=np.int64).reshape(-1)
        self.process_ids = np.asarray(self.process_ids, dtype=np.int64).reshape(-1)
        n = len(self.replica_ids)
        if len(self.process_ids) != n or n == 0:
            raise ValueError("a layout needs one start, stop, replica id and process id per device")
        self.starts = np.asarray(self.starts, dtype=np.int64).reshape(n, nd)
        self.stops = np.asarray(self.stops, dtype=np.int64).reshape(n, nd)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    @cached_property
    def shards(self) -> ShardGroups:
        return ShardGroups.of(self)


@lru_cache(maxsize=64)
def host_layout(shape: tuple[int, ...], itemsize: int, process_count: int) -> ArrayLayout:
    """A host (NumPy) value: every process holds all of it, as replica number `process`."""
    nd = len(shape)
    n = process_count
    return ArrayLayout(
        shape,
        itemsize,
        np.zeros((n, nd), dtype=np.int64),
        np.tile(np.asarray(shape, dtype=np.int64), (n, 1)),
        np.arange(n),
        np.arange(n),
    )


@lru_cache(maxsize=64)
def own_layout(shape: tuple[int, ...], itemsize: int, process: int) -> ArrayLayout:
    """A host value that only `process` is known to hold (a save of differing trees: which other
    processes hold it, no process knows without asking)."""
    nd = len(shape)
    out = ArrayLayout(
        shape, itemsize, np.zeros((1, nd), np.int64), np.asarray([shape], np.int64).reshape(1, nd),
        np.zeros(1, np.int64), np.asarray([process]),
    )  # fmt: skip
    out.memo.own = True
    return out


Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A box of an array: (start, stop) per axis, stop exclusive."""


def slices_to_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """The box [start, stop) of a basic (step 1) index into an array of `shape`."""
    start, stop = [], []
    for s, n in zip(index, shape, strict=True):
        a, b, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {index} is not supported")
        start.append(a)
        stop.append(b)
    return tuple(start), tuple(stop)


@dataclass(frozen=True, eq=False)
class ShardGroups:
    """The unique boxes of a layout and, for each, the processes holding a copy.

    Candidates of box u are rows cand_ptr[u]:cand_ptr[u+1] of cand_process / cand_row,
    ordered by the lowest replica id each process holds (so candidate 0 holds replica 0).
    """

    starts: np.ndarray  # (U, ndim)
    stops: np.ndarray  # (U, ndim)
    nbytes: np.ndarray  # (U,)
    cand_ptr: np.ndarray  # (U + 1,)
    cand_process: np.ndarray  # (M,)
    cand_row: np.ndarray  # (M,) the device row whose shard is read for this candidate

    @property
    def count(self) -> int:
        return len(self.nbytes)

    @cached_property
    def cand_box(self) -> np.ndarray:
        """The box of each candidate entry."""
        return np.repeat(np.arange(self.count), self.num_candidates)

    @cached_property
    def _by_process(self) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(self.cand_process, kind="stable")
        return order, self.cand_process[order]

    def candidates_of(self, process: int) -> np.ndarray:
        """Positions of the candidate entries of `process` (the boxes it holds)."""
        order, procs = self._by_process
        lo, hi = np.searchsorted(procs, [process, process + 1])
        return order[lo:hi]

    @property
    def num_candidates(self) -> np.ndarray:
        return np.diff(self.cand_ptr)

    @staticmethod
    def of(layout: ArrayLayout) -> ShardGroups:
        nd = layout.ndim
        boxes = np.concatenate([layout.starts, layout.stops], axis=1)
        if nd == 0:
            box_of_row = np.zeros(len(layout.replica_ids), dtype=np.int64)
            ustarts = np.zeros((1, 0), dtype=np.int64)
            ustops = np.zeros((1, 0), dtype=np.int64)
        else:
            ubox, box_of_row = unique_rows(boxes)
            ustarts, ustops = ubox[:, :nd], ubox[:, nd:]
        nproc = int(layout.process_ids.max()) + 1
        # One candidate per (box, process): the row with the lowest replica id there.
        order = np.lexsort((layout.replica_ids, layout.process_ids, box_of_row))
        key = box_of_row[order] * nproc + layout.process_ids[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = key[1:] != key[:-1]
        rows = order[first]
        # Order each box's candidates by the replica id they hold.
        rows = rows[np.lexsort((layout.replica_ids[rows], box_of_row[rows]))]
        cand_box = box_of_row[rows]
        ubox_count = len(ustarts)
        cand_ptr = np.zeros(ubox_count + 1, dtype=np.int64)
        np.cumsum(np.bincount(cand_box, minlength=ubox_count), out=cand_ptr[1:])
        extents = ustops - ustarts
        volume = np.prod(extents, axis=1, dtype=np.int64) if nd else np.ones(1, np.int64)
        return ShardGroups(
            starts=ustarts,
            stops=ustops,
            nbytes=volume * layout.itemsize,
            cand_ptr=cand_ptr,
            cand_process=layout.process_ids[rows],
            cand_row=rows.astype(np.int64),
        )
