"""Requests: what to build for a leaf, and building it from its filled host buffers.

`make_request` matches a saved array leaf with its target (None: NumPy as saved; a NumPy
array; a jax.Array or ShapeDtypeStruct, whose sharding gives the boxes this process holds)
and plans its boxes. A request is a `Fill` (fills.py): its boxes get aligned host buffers
when its batch is read (so that only one batch's buffers are alive at a time), and
`finish` turns the filled buffers into the value asked for. `execute` runs the batch loop
over requests. JAX is imported only where a jax target is met (the JAX wing, through
frameworks.jax_wing).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from ..dtypes import dtype_from_name
from ..errors import TargetMismatchError
from ..format import ArrayLeaf
from ..format.kinds import LeafKind
from ..frameworks import is_jax_array, is_prng_key_dtype, is_shape_dtype_struct, jax_wing
from .buffers import ALIGN, BATCH_ITEMS, Dest, ReadDests, ReadStats, aligned_empty
from .fills import Expand, fill


@dataclass(frozen=True)
class _BoxPlan:
    """The boxes one process holds of arrays of one shape and sharding, cut into one
    allocation at 64-byte aligned offsets, computed once for all such arrays (a state of
    many small arrays has few distinct ones)."""

    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]], ...]
    starts: tuple[np.ndarray, ...]  # read-only: shared by the dests of every such array
    stops: tuple[np.ndarray, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # of each box in the allocation, then its size
    sizes: tuple[int, ...]


@dataclass
class Request:
    """One leaf to produce, a `Fill` (fills.py). kind: 'numpy', 'scalar', 'jax', 'key'
    (typed PRNG key), 'boxes' (the host arrays of this process's boxes of `sharding`, in
    the order of its box plan: what the JAX wing's read-once stacks, jax/read_once.py).

    Its buffers are made when its batch is read (`dests`) and dropped once `finish` has
    built `value` from them."""

    saved: ArrayLeaf
    kind: str
    dtype: np.dtype
    sharding: Any = None
    box_plan: _BoxPlan | None = None
    value: Any = None
    _buffers: list[Dest] = field(default_factory=list)

    @property
    def buffered(self) -> int:
        """The bytes of the host buffers this request reads into (none before it is
        planned: an unplanned request has no buffers)."""
        return sum(self.box_plan.sizes) if self.box_plan is not None else 0

    def dests(self) -> list[Dest]:
        """Each box of its plan with its aligned host buffer, allocated on the first call
        (one allocation per leaf: a buffer per box would cost one per shard)."""
        plan = self.box_plan
        if self._buffers or plan is None:
            return self._buffers
        whole = aligned_empty(plan.offsets[-1])
        saved = self.saved
        self._buffers.extend(
            Dest(saved, s, e, whole[at : at + n], shape)
            for s, e, at, n, shape in zip(
                plan.starts,
                plan.stops,
                plan.offsets,
                plan.sizes,
                plan.shapes,
                strict=False,  # (offsets has one more)
            )
        )
        return self._buffers

    def finish(self) -> None:
        """`value` built from the filled buffers, which are dropped."""
        self.value = _build(self, self._buffers)
        self._buffers.clear()


def make_request(saved: ArrayLeaf, target: Any, url: str, mesh: Any = None) -> Request:
    """What to build for a saved array leaf given its target leaf (None: NumPy as saved)."""
    if target is None:
        if saved.kind == LeafKind.PRNG_KEY:
            kind = "key"
        else:
            kind = "scalar" if saved.kind == LeafKind.SCALAR else "numpy"
        return request_boxes(Request(saved, kind, dtype_from_name(saved.dtype)), None)
    # Leaves alike (the same target shape, dtype and sharding, saved alike) resolve alike:
    # what they ask for is worked out once for all of them, since a state of many arrays has
    # few kinds of leaf (the sharding by object: hashing one costs more than the rest).
    sharding = getattr(target, "sharding", None)
    t_shape, t_dtype = getattr(target, "shape", None), getattr(target, "dtype", None)
    key = (type(target), t_shape, t_dtype, id(sharding), id(mesh), saved.dtype, saved.kind,
           saved.shape)  # fmt: skip
    hit = _resolved.get(key)
    if hit is not None and hit[0] is sharding and hit[1] is mesh:
        kind, dtype, resolved, plan = hit[2]
    else:
        kind, dtype, resolved = _resolve(saved, target, url, mesh)
        try:
            plan = _plan_of(saved, resolved if kind == "jax" else None)
        except ValueError as e:  # (JAX's IndivisibleError: the sharding does not cut the shape)
            raise TargetMismatchError(f"{url}: leaf {saved.name!r}: {e}") from e
        if t_shape is not None and not _on_abstract_mesh(
            sharding
        ):  # placed on the mesh in context: asked each time
            if len(_resolved) >= 4096:
                _resolved.clear()
            _resolved[key] = (sharding, mesh, (kind, dtype, resolved, plan))
    return Request(saved, kind, dtype, resolved, box_plan=plan)


_resolved: dict[tuple[Any, ...], tuple[Any, Any, tuple[str, np.dtype, Any, _BoxPlan]]] = {}


def _on_abstract_mesh(sharding: Any) -> bool:
    if sharding is None:
        return False
    return jax_wing().is_abstract_mesh(getattr(sharding, "mesh", None))  # (JAX is loaded)


def _resolve(saved: ArrayLeaf, target: Any, url: str, mesh: Any) -> tuple[str, np.dtype, Any]:
    """(kind, dtype, sharding) of the request for `saved` given its target leaf, checked."""
    name = saved.name
    saved_dtype = dtype_from_name(saved.dtype)
    jax_target = is_jax_array(target) or is_shape_dtype_struct(target)
    if jax_target:
        shape, dtype = tuple(target.shape), target.dtype
        sharding = jax_wing().resolve_target_sharding(
            getattr(target, "sharding", None), mesh, leaf=name
        )
    elif isinstance(target, np.ndarray | np.generic):
        shape, dtype, sharding = tuple(np.shape(target)), target.dtype, None
    else:
        raise TargetMismatchError(
            f"{url}: target for leaf {name!r} is a {type(target).__name__}; expected jax.Array, "
            "jax.ShapeDtypeStruct or np.ndarray"
        )
    wants_key = is_prng_key_dtype(dtype)
    if wants_key and saved.kind != LeafKind.PRNG_KEY:
        raise TargetMismatchError(
            f"{url}: leaf {name!r} was saved as {saved.dtype} data, the target asks for PRNG keys"
        )
    expected = saved.logical_shape if wants_key else saved.shape
    if shape != expected:
        raise TargetMismatchError(
            f"{url}: leaf {name!r} has shape {expected} in the checkpoint, the target asks for {shape}"
        )
    # Typed keys that a JAX target asks for as their key data (Orbax's recipe of a target,
    # `to_shape_dtype_struct`, makes them so) come back typed, as Orbax restores them
    as_data = saved.kind == LeafKind.PRNG_KEY and jax_target and dtype == saved_dtype
    if wants_key or as_data:
        return "key", saved_dtype, sharding
    if sharding is None:
        return ("scalar" if isinstance(target, np.generic) else "numpy"), np.dtype(dtype), None
    return "jax", np.dtype(dtype), sharding


_BoxKey = tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]], ...]
_box_plans: dict[tuple[int, int], tuple[_BoxKey, _BoxPlan]] = {}


def _box_plan_of(boxes: _BoxKey, itemsize: int) -> _BoxPlan:
    """plan_of_boxes, looked up by the boxes object (local_device_boxes gives arrays sharded
    alike the same one): hashing the boxes, devices and all, would cost more than the
    plan saves. The entry keeps the object, so its id stays its own."""
    hit = _box_plans.get((id(boxes), itemsize))
    if hit is not None and hit[0] is boxes:
        return hit[1]
    if len(_box_plans) >= 4096:
        _box_plans.clear()
    plan = plan_of_boxes(boxes, itemsize)
    _box_plans[(id(boxes), itemsize)] = (boxes, plan)
    return plan


@functools.lru_cache(maxsize=4096)
def _whole_box_plan(shape: tuple[int, ...], itemsize: int) -> _BoxPlan:
    """The plan of one box, the whole array, held by no device (NumPy targets)."""
    return plan_of_boxes(((tuple(0 for _ in shape), shape, ()),), itemsize)


@functools.lru_cache(maxsize=4096)
def plan_of_boxes(
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]], ...], itemsize: int
) -> _BoxPlan:
    """The plan of `boxes`, each (start, stop, the devices that take it), of `itemsize`
    bytes per element."""

    def fixed(v: tuple[int, ...]) -> np.ndarray:
        a = np.asarray(v, dtype=np.int64)
        a.flags.writeable = False
        return a

    shapes = tuple(tuple(b - a for a, b in zip(s, e, strict=True)) for s, e, _ in boxes)
    sizes = tuple(math.prod(sh) * itemsize for sh in shapes)
    offsets = (0, *accumulate(-(-n // ALIGN) * ALIGN for n in sizes))
    return _BoxPlan(
        boxes, tuple(fixed(s) for s, _, _ in boxes), tuple(fixed(e) for _, e, _ in boxes),
        shapes, offsets, sizes,
    )  # fmt: skip


def _plan_of(saved: ArrayLeaf, sharding: Any) -> _BoxPlan:
    """The boxes this process holds of `saved` on `sharding` (None: the whole array)."""
    shape = saved.shape
    itemsize = dtype_from_name(saved.dtype).itemsize
    if sharding is None:
        return _whole_box_plan(shape, itemsize)
    return _box_plan_of(jax_wing().local_device_boxes(sharding, shape), itemsize)


def request_boxes(req: Request, sharding: Any) -> Request:
    """`req` planned to read each box this process holds on `sharding` (None: one, the
    whole array)."""
    req.box_plan = _plan_of(req.saved, sharding)
    return req


def _build(req: Request, dests: list[Dest]) -> Any:
    """The value a request asks for (NumPy, scalar, typed keys or a jax.Array) from its
    filled host buffers."""
    saved_dtype = dtype_from_name(req.saved.dtype)

    def host(d: Dest, dtype: np.dtype) -> np.ndarray:
        a = d.buf.view(saved_dtype).reshape(d.shape)
        return a if dtype == saved_dtype else a.astype(dtype)

    if req.kind in ("numpy", "scalar"):
        a = host(dests[0], req.dtype)
        return a[()] if req.kind == "scalar" else a
    wing = jax_wing()  # keys, jax.Arrays
    if req.kind == "key":
        # Key arrays are small: every process reads all of the key data and builds its part.
        impl = req.saved.key_impl
        data = host(dests[0], saved_dtype)
        return wing.key_array(data, impl, req.sharding)
    plan = req.box_plan
    assert plan is not None  # (every request is planned when made)
    dtype = req.dtype
    hosts = [host(d, dtype) for d in dests]
    if req.kind == "boxes":
        return hosts
    return wing.array_from_host_boxes(req.saved.shape, req.sharding, plan.boxes, hosts, dtype)


def execute(
    reqs: list[Request],
    read: ReadDests,
    *,
    memory_budget: int | None,
    stats: ReadStats,
    expand: Expand | None = None,
) -> list[Any]:
    """Read and build every request, in batches that fit the memory budget (jax.Arrays
    only); returns the built values in the order of `reqs`.

    On the CPU backend a jax.Array keeps its host buffer (XLA aliases it), so batches there
    only bound the bytes. On an accelerator a buffer is dropped once its device copy is
    made; batches of at most `BATCH_ITEMS` requests then keep the host memory of a restore
    of many small arrays (buffers and the objects of their reads) a fraction of the
    state's, not all of it at once."""
    budget = None if all(r.kind in ("numpy", "scalar") for r in reqs) else memory_budget
    plans = {id(r.box_plan): r.box_plan for r in reqs if r.box_plan is not None}
    box_devices = [devs for p in plans.values() for _, _, devs in p.boxes if devs]
    if any(len(devs) > 1 and devs[0].platform == "cpu" for devs in box_devices):
        jax_wing().start_cpu_donation_check()  # overlaps the reads (see array_from_host_boxes)
    on_device = any(devs[0].platform != "cpu" for devs in box_devices)
    fill(reqs, read, stats, budget=budget, most=BATCH_ITEMS if on_device else None, expand=expand)
    values = [r.value for r in reqs]
    for r in reqs:
        r.value = None  # (the caller holds the values, not its requests)
    return values
