"""The blocking phase of a save: bring every owned slice to host memory, under a byte budget.

On the CPU backend a NumPy view of a device buffer shares its memory, so staging there costs
no copy at all, provided that donating the array later cannot overwrite the memory the view
holds. That holds on the JAX versions we support (the view keeps the buffer alive, and
donation then falls back to a fresh output buffer); `cpu_donation_keeps_memory` checks it
once per process, and where it fails we copy. A synchronous save needs no check: nothing
can donate the array before it returns.

On accelerators every owned slice is copied to the host: all copies are started at once
(`copy_to_host_async`) and then awaited. Slices beyond `budget` bytes are not copied in the
blocking phase: the background phase copies them just before writing them, which requires
the caller not to donate or delete those arrays until the save has finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import SnapshardError
from .frameworks import jax_wing
from .planning import WritePlan
from .planning.layout import Box
from .save_leaves import SaveArray


@dataclass
class StagedItem:
    """One box this process writes: its bytes on the host, or the device array to copy later."""

    leaf: int
    name: str
    start: np.ndarray
    stop: np.ndarray
    nbytes: int
    host: np.ndarray | None = None
    deferred: Any = None  # a jax.Array whose host copy the background phase makes

    def materialize(self) -> np.ndarray:
        if self.host is not None:
            return self.host
        try:
            return np.asarray(self.deferred)
        except RuntimeError as e:
            raise SnapshardError(
                f"leaf {self.name!r}: its device buffer was deleted (donated?) before the background "
                "phase copied it; raise the save's host memory budget or wait for the save before donating"
            ) from e

    def release(self) -> None:
        self.host = None
        self.deferred = None


Snapshot = dict[int, dict[Box, np.ndarray]]


def _on_host(data: Any, asynchronous: bool = True) -> np.ndarray | None:
    """The zero-copy host view of a CPU shard where that is safe (`asynchronous`: the view
    outlives the call that staged it), else None."""
    if data.device.platform != "cpu":
        return None
    return np.asarray(data) if _views_safe(asynchronous) else None


def _views_safe(asynchronous: bool) -> bool:
    """Whether a CPU shard may be staged as a view of its buffer (see the module's doc)."""
    return not asynchronous or jax_wing().cpu_donation_keeps_memory()  # a jax.Array is staged


def host_snapshot(arrays: list[tuple[int, SaveArray]], process: int) -> Snapshot:
    """Every unique box of every device array that this process holds, on the host.

    One device-to-host copy per box (none on CPU); a save of the same step can stage its
    owned slices from this snapshot instead of from the devices again.
    """
    out: Snapshot = {}
    pending: list[tuple[dict[Box, np.ndarray], Box, Any]] = []
    for leaf_index, arr in arrays:
        if arr.devices is None:
            continue
        lay = arr.layout
        shards = {s.device: s for s in arr.source.addressable_shards}
        boxes: dict[Box, np.ndarray] = {}
        out[leaf_index] = boxes
        seen: set[Box] = set()
        for row in np.flatnonzero(lay.process_ids == process):
            box = (tuple(lay.starts[row].tolist()), tuple(lay.stops[row].tolist()))
            if box in seen:
                continue
            seen.add(box)
            data = shards[arr.devices[row]].data
            view = _on_host(data)
            if view is not None:
                boxes[box] = view
            else:
                data.copy_to_host_async()
                pending.append((boxes, box, data))
    for boxes, box, data in pending:
        boxes[box] = (
            np.array(np.asarray(data), copy=True)
            if data.device.platform == "cpu"
            else np.asarray(data)
        )
    return out


def _rel(arr: SaveArray, row: int, start: np.ndarray, stop: np.ndarray) -> tuple[slice, ...]:
    if arr.devices is None:
        return tuple(slice(x, y) for x, y in zip(start.tolist(), stop.tolist(), strict=True))
    origin = arr.layout.starts[row].tolist()
    return tuple(
        slice(x - o, y - o) for x, y, o in zip(start.tolist(), stop.tolist(), origin, strict=True)
    )


def planned_items(
    arrays: list[tuple[int, SaveArray]], plan: WritePlan, process: int
) -> list[tuple[StagedItem, int, SaveArray, int]]:
    """This process's items of `plan` that hold bytes, in plan order: the item (nothing
    staged yet), the index of its array in `arrays`, the array, and the layout row the
    item is cut from. Every framework's staging walks this."""
    t = plan.process_items(process)
    plans = plan.arrays
    out = []
    rows_of: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}  # by id(starts)
    for a, k, nbytes, row in zip(
        t.array.tolist(), t.item.tolist(), t.nbytes.tolist(), t.source_row.tolist(), strict=True
    ):
        leaf_index, arr = arrays[a]
        p = plans[a]
        if p.whole_boxes:  # arrays of one layout share its boxes: rows cut once, not per item
            boxes = rows_of.get(id(p.starts))
            if boxes is None:
                boxes = rows_of[id(p.starts)] = (list(p.starts), list(p.stops))
            item = StagedItem(leaf_index, arr.name, boxes[0][k], boxes[1][k], nbytes)
        else:
            item = StagedItem(leaf_index, arr.name, p.starts[k], p.stops[k], nbytes)
        out.append((item, a, arr, row))
    return out


class _Shards:
    """The addressable shards of the arrays being staged, by layout row. An array lists its
    shards in its sharding's device order, so the row of each is found once per sharding
    and layout, not per shard."""

    def __init__(self) -> None:
        self.index: dict[tuple[Any, int], list[int | None]] = {}
        self.array = -1
        self.shards: list[Any] = []
        self.rows: list[int | None] = []

    def data(self, a: int, arr: SaveArray, row: int) -> Any:
        """The single-device array of array number `a` (`arr`) of layout row `row`."""
        if a != self.array:
            self.array, self.shards = a, arr.source.addressable_shards
            assert arr.devices is not None
            key = (arr.source.sharding, id(arr.devices))
            rows = self.index.get(key)
            if rows is None:
                at = {s.device: i for i, s in enumerate(self.shards)}
                rows = self.index[key] = [at.get(d) for d in arr.devices]
            self.rows = rows
        i = self.rows[row]
        assert i is not None, "a process stages only the shards it holds"
        return self.shards[i].data


def _covers(rel: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """Whether slices relative to a shard of `shape` take all of it."""
    return all(s.start == 0 and s.stop == n for s, n in zip(rel, shape, strict=True))


def stage(
    arrays: list[tuple[int, SaveArray]],
    plan: WritePlan,
    process: int,
    *,
    budget: int | None = None,
    asynchronous: bool = False,
    snapshot: Snapshot | None = None,
) -> tuple[list[StagedItem], int]:
    """Stage this process's items; returns them and the host bytes copied for them.
    `asynchronous`: the caller goes on before the items are written, and may change host
    values or donate device arrays meanwhile.

    With a `snapshot` (see host_snapshot) device arrays are staged from it, copying nothing."""
    items: list[StagedItem] = []
    copying: list[tuple[StagedItem, Any]] = []
    used = 0
    shards = _Shards()
    views: bool | None = None  # whether CPU shards may be staged as views; asked once
    whole_boxes = [p.whole_boxes for p in plan.arrays]
    for item, a, arr, row in planned_items(arrays, plan, process):
        leaf_index, nbytes = item.leaf, item.nbytes
        items.append(item)
        if arr.devices is None:  # a host value: the caller may change it once we return
            cut = _rel(arr, row, item.start, item.stop)
            item.host = np.array(arr.source[cut], copy=True) if asynchronous else arr.source[cut]
            used += nbytes if asynchronous else 0
            continue
        # Items cut from whole boxes are their source row's whole shard: nothing to slice.
        rel = None if whole_boxes[a] else _rel(arr, row, item.start, item.stop)
        if snapshot is not None:
            box = (tuple(arr.layout.starts[row].tolist()), tuple(arr.layout.stops[row].tolist()))
            held = snapshot[leaf_index][box]
            item.host = held if rel is None else held[rel]
            continue
        # A fully replicated array is read through itself, as one copy: asking for its
        # shards makes an object for every device's copy (~8 us each, on every save, since a
        # training step's arrays are new ones).
        replicated = arr.source.is_fully_replicated
        cpu = arr.devices[row].platform == "cpu"
        if cpu:
            views = _views_safe(asynchronous) if views is None else views
            if views:
                data = arr.source if replicated else shards.data(a, arr, row)
                item.host = np.asarray(data) if rel is None else np.asarray(data)[rel]
                continue
        if replicated and (rel is None or _covers(rel, arr.shape)):
            data, whole = arr.source, True
        else:
            data = shards.data(a, arr, row)
            whole = rel is None or _covers(rel, data.shape)
        src = data if whole else data[rel]
        if budget is not None and used + nbytes > budget:
            item.deferred = src
            continue
        used += nbytes
        if cpu:
            item.host = np.array(np.asarray(src), copy=True)
        else:
            src.copy_to_host_async()
            copying.append((item, src))
    for item, src in copying:
        item.host = np.asarray(src)
    return items, used
