"""Requests: what to build for a leaf, and building it from its filled host buffers.

`make_request` matches a saved array leaf with its target (None: NumPy as saved; a NumPy
array; a jax.Array or ShapeDtypeStruct, whose sharding gives the boxes this process holds)
and gives each box an aligned host buffer; `build` turns the filled buffers into the value
asked for. JAX is imported only where a jax target is met (adapters/jax_arrays.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import numpy as np

from ..adapters.loaded import is_jax_array, is_prng_key_dtype, is_shape_dtype_struct
from ..dtypes import dtype_from_name
from ..errors import TargetMismatchError
from ..format import ArrayLeaf
from ..format.kinds import LeafKind
from .buffers import ALIGN, Dest, aligned_empty


@dataclass
class Request:
    """One leaf to produce. kind: 'numpy', 'scalar', 'jax', 'key' (typed PRNG key)."""

    saved: ArrayLeaf
    kind: str
    dtype: np.dtype
    sharding: Any = None
    dests: list[Dest] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(d.buf.nbytes for d in self.dests)


def make_request(saved: ArrayLeaf, target: Any, url: str, mesh: Any = None) -> Request:
    """What to build for a saved array leaf given its target leaf (None: NumPy as saved)."""
    name = saved.name
    saved_dtype = dtype_from_name(saved.dtype)
    if target is None:
        if saved.kind == LeafKind.PRNG_KEY:
            return request_boxes(Request(saved, "key", saved_dtype), None)
        kind = "scalar" if saved.kind == LeafKind.SCALAR else "numpy"
        return request_boxes(Request(saved, kind, saved_dtype), None)
    if is_jax_array(target) or is_shape_dtype_struct(target):
        from ..adapters.jax_arrays import resolve_target_sharding

        shape, dtype = tuple(target.shape), target.dtype
        sharding = resolve_target_sharding(getattr(target, "sharding", None), mesh, leaf=name)
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
    if wants_key:
        return request_boxes(Request(saved, "key", saved_dtype, sharding), None)
    out_dtype = np.dtype(dtype)
    if sharding is None:
        kind = "scalar" if isinstance(target, np.generic) else "numpy"
        return request_boxes(Request(saved, kind, out_dtype), None)
    return request_boxes(Request(saved, "jax", out_dtype, sharding), sharding)


def request_boxes(req: Request, sharding: Any) -> Request:
    shape = req.saved.shape
    itemsize = dtype_from_name(req.saved.dtype).itemsize
    boxes: Sequence[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]]
    if sharding is None:
        boxes = [(tuple(0 for _ in shape), shape, ())]
    else:
        from ..adapters.jax_arrays import local_device_boxes

        boxes = local_device_boxes(sharding, shape)
    sizes = [math.prod(b - a for a, b in zip(s, e, strict=True)) * itemsize for s, e, _ in boxes]
    # One allocation per leaf, cut at 64-byte aligned offsets: a buffer per box would cost
    # an allocation per shard.
    offsets = [0, *accumulate(-(-n // ALIGN) * ALIGN for n in sizes)]
    whole = aligned_empty(offsets[-1])
    for (start, stop, devices), at, nbytes in zip(boxes, offsets[:-1], sizes, strict=True):
        s, e = np.asarray(start, dtype=np.int64), np.asarray(stop, dtype=np.int64)
        req.dests.append(Dest(req.saved, s, e, whole[at : at + nbytes], devices))
    return req


def build(req: Request) -> Any:
    """The value a request asks for (NumPy, scalar, typed keys or a jax.Array) from its
    filled host buffers."""
    saved_dtype = dtype_from_name(req.saved.dtype)

    def host(d: Dest, dtype: np.dtype) -> np.ndarray:
        a = d.buf.view(saved_dtype).reshape(d.shape)
        return a if dtype == saved_dtype else a.astype(dtype)

    if req.kind in ("numpy", "scalar"):
        a = host(req.dests[0], req.dtype)
        return a[()] if req.kind == "scalar" else a
    from ..adapters.jax_arrays import array_from_host_boxes, key_array  # keys, jax.Arrays

    if req.kind == "key":
        # Key arrays are small: every process reads all of the key data and builds its part.
        impl = req.saved.key_impl
        data = host(req.dests[0], saved_dtype)
        return key_array(data, impl, req.sharding)
    boxes = [
        (tuple(d.start.tolist()), tuple(d.stop.tolist()), host(d, req.dtype), d.devices)
        for d in req.dests
    ]
    return array_from_host_boxes(req.saved.shape, req.sharding, boxes)
