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

Staging memory. The copies that snapshard makes itself (the host values of an asynchronous
save, CPU shards where views are not safe) go into exact-size buffers that a `HostPool`
keeps from one save to the next, where the save has an owner that outlives it: a
CheckpointManager makes a `SavePools`, hands it to its saves (`pools_for_saves`) and closes
it in `close()`, which releases the buffers. A save of the same state takes the very same
buffers again; the pool holds at most what the last save took (buffers the last save did
not ask for are dropped), so no more than the bytes it staged: within `budget`, but for the
host values, which an asynchronous save must copy whatever the budget. A save without an
owner (`snapshard.save_async`) allocates its copies and frees them when it ends. Copies
from an accelerator are JAX's own host copy of each shard (`np.asarray` after
`copy_to_host_async`), exact in size and freed with the save's items: JAX copies into no
buffer of ours, and copying them once more to reuse one would cost the blocking phase a
second pass over every byte.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, TypeVar

import numpy as np

from ..errors import SnapshardError
from ..frameworks import jax_wing
from ..planning import WritePlan
from ..planning.layout import Box
from ..reading.buffers import aligned_empty
from .save_array import SaveArray

E = TypeVar("E")  # what a pool holds per buffer (torch: the array and its pinned tensor)
A = ParamSpec("A")  # what a pool's `take` asks for a buffer (the byte size, ...)
P = TypeVar("P", bound="HostPool[Any]")


class HostPool(Generic[E]):
    """Host buffers of exact byte sizes reused across saves (see the module's doc).

    A save borrows through a `Borrower` of its own (`borrower()`): one buffer per item it
    copies (`take`, by a key: the byte size, and what else makes buffers differ), all given
    back when its background phase ends (`release`). The pool then holds those and only
    those: buffers no save asked for in the last round are dropped, so it holds at most what
    the saves in flight need. `close()` drops every buffer; a pool closed keeps none given
    back after, and still lends new ones (a save that runs after its owner closed)."""

    def __init__(self) -> None:
        self._free: dict[Hashable, list[E]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _take(self, key: Hashable, make: Callable[[], E]) -> E:
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        return make()

    def give_back(self, bufs: list[E]) -> None:
        """Take back every buffer the last round of saves took (see the class's doc)."""
        fresh: dict[Hashable, list[E]] = {}
        for b in bufs:
            fresh.setdefault(self._key(b), []).append(b)
        with self._lock:
            self._free = {} if self._closed else fresh

    def _key(self, entry: E) -> Hashable:
        """The key `take` lends `entry` by."""
        raise NotImplementedError

    def _entry_bytes(self, entry: E) -> int:
        raise NotImplementedError

    def cached_bytes(self) -> int:
        """The bytes of the buffers the pool holds for the next save."""
        with self._lock:
            return sum(self._entry_bytes(b) for v in self._free.values() for b in v)

    def close(self) -> None:
        """Release every buffer held (those lent out now are dropped when given back)."""
        with self._lock:
            self._closed = True
            self._free = {}


class Borrower(Generic[A, E]):
    """The buffers that one save borrows from a HostPool, given back together.

    `take` lends a buffer as the pool's own `take` does (the same arguments) and notes it in
    `taken`; `release()`, once the save has ended however it ended, gives every buffer noted
    back to the pool for the next save (the pool then holds those and only those, even none)
    and forgets them. Made by the pool's `borrower()`, one per save: each save's adapter
    (JAX's, torch's) holds its own and releases it once (a second `release()` would give
    the pool an empty round, which drops what it holds)."""

    def __init__(self, pool: HostPool[E], take: Callable[A, E]) -> None:
        self.pool = pool
        self._lend = take
        self.taken: list[E] = []  # lent and not given back yet

    def take(self, *args: A.args, **kwargs: A.kwargs) -> E:
        buf = self._lend(*args, **kwargs)
        self.taken.append(buf)
        return buf

    def release(self) -> None:
        taken, self.taken = self.taken, []
        self.pool.give_back(taken)


class HostArrays(HostPool[np.ndarray]):
    """JAX's staging pool: 64-byte aligned uint8 buffers by byte size."""

    def take(self, nbytes: int) -> np.ndarray:
        return self._take(nbytes, lambda: aligned_empty(nbytes))

    def borrower(self) -> Borrower[[int], np.ndarray]:
        """What one save borrows (Borrower: `take(nbytes)`, `release()`)."""
        return Borrower(self, self.take)

    def _key(self, entry: np.ndarray) -> Hashable:
        return entry.nbytes

    def _entry_bytes(self, entry: np.ndarray) -> int:
        return int(entry.nbytes)


class SavePools:
    """The staging pools of one owner of saves (a CheckpointManager): one per kind of pool
    (JAX's `HostArrays`, snapshard.torch's `HostBuffers`), made when a save first asks for
    it; `close()` releases them all."""

    def __init__(self) -> None:
        self._pools: dict[type[Any], HostPool[Any]] = {}
        self._lock = threading.Lock()

    def pool(self, cls: type[P]) -> P:
        with self._lock:
            found = self._pools.get(cls)
            if found is None:
                found = self._pools[cls] = cls()
            assert isinstance(found, cls)
            return found

    def cached_bytes(self) -> int:
        with self._lock:
            pools = list(self._pools.values())
        return sum(p.cached_bytes() for p in pools)

    def close(self) -> None:
        with self._lock:
            pools = list(self._pools.values())
        for p in pools:
            p.close()


# The pools of the saves started in this context (a manager's save): every framework's
# adapter takes its pool from here, since the manager starts saves through the framework's
# `start_save` without knowing which adapter stages them.
_current: ContextVar[SavePools | None] = ContextVar("snapshard_save_pools", default=None)


@contextlib.contextmanager
def pools_for_saves(pools: SavePools) -> Iterator[None]:
    """Saves started inside stage their copies into `pools`."""
    token = _current.set(pools)
    try:
        yield
    finally:
        _current.reset(token)


def current_pool(cls: type[P]) -> P | None:
    """The pool of kind `cls` of the saves started here (None: the save has no owner)."""
    pools = _current.get()
    return None if pools is None else pools.pool(cls)


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
            if data.device.platform == "cpu" and _views_safe(True):  # (the view outlives the call)
                boxes[box] = np.asarray(data)
            else:
                data.copy_to_host_async()
                pending.append((boxes, box, data))
    for boxes, box, data in pending:  # a CPU shard's view copied: its buffer may be donated
        boxes[box] = np.array(data) if data.device.platform == "cpu" else np.asarray(data)
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


def _copy(src: Any, take: Callable[[int], np.ndarray] | None) -> np.ndarray:
    """A host copy of `src` (a NumPy array, or a CPU jax.Array): into a buffer from `take`
    (a pool's, of its exact byte size) where given, else a new array."""
    view = np.asarray(src)
    if take is None:
        return np.array(view, copy=True)
    dst = take(view.nbytes).view(view.dtype).reshape(view.shape)
    np.copyto(dst, view)
    return dst


def stage(
    arrays: list[tuple[int, SaveArray]],
    plan: WritePlan,
    process: int,
    *,
    budget: int | None = None,
    asynchronous: bool = False,
    snapshot: Snapshot | None = None,
    take: Callable[[int], np.ndarray] | None = None,
) -> tuple[list[StagedItem], int]:
    """Stage this process's items; returns them and the host bytes copied for them.
    `asynchronous`: the caller goes on before the items are written, and may change host
    values or donate device arrays meanwhile. `take(nbytes)`: the buffer each copy made
    on the host goes into (a pool's); None: new arrays.

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
            item.host = _copy(arr.source[cut], take) if asynchronous else arr.source[cut]
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
            item.host = _copy(src, take)
        else:
            src.copy_to_host_async()
            copying.append((item, src))
    for item, src in copying:
        item.host = np.asarray(src)
    return items, used
