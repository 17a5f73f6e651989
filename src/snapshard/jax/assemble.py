"""Host boxes onto devices: the jax.Array a restore builds from its filled host buffers, with
one batched transfer per array.

`array_from_host_boxes(shape, sharding, boxes, hosts)` is the array on `sharding` whose
shards are the host arrays `hosts`, one per box of `boxes` (`local_device_boxes`). How the
arrays of one sharding and box list are put together (which box each device takes, shared
host memory or device copies) is worked out once for all of them (`_Assembly`).

The transfer. `jax.make_array_from_callback` costs about 35 µs per array on a CPU host, of
which some 15 are its checks and lookups around the one transfer JAX makes
(`pxla.batched_device_put`): a restore of 100,000 small arrays pays them 100,000 times. So
where this JAX has that function with the signature relied on (JAX 0.5.3 to 0.12 do), the
transfer is called directly, with each device's host array in the sharding's device order
and the abstract value made once per shape, dtype and sharding. make_array_from_callback
remains the way for what it converts (a dtype this JAX would canonicalize, such as
float64 without x64) and for any JAX without that function: the results are the same
arrays (tests/test_jax_transfer.py compares them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ..planning.layout import Box, slices_to_box
from .arrays import DeviceBox, cpu_donation_keeps_memory

Put = Callable[[Any, jax.sharding.Sharding, list[np.ndarray], list[Any]], jax.Array]


def _direct_put() -> tuple[Put, Callable[[tuple[int, ...], np.dtype, Any], Any]] | None:
    """JAX's batched transfer and the abstract value of an array on a sharding, where this
    JAX has both as relied on; None elsewhere."""
    try:
        from jax._src import core
        from jax._src.interpreters import pxla

        put, update = pxla.batched_device_put, core.update_aval_with_sharding
        names = list(inspect.signature(put).parameters)[:4]
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    if names != ["aval", "sharding", "xs", "devices"]:
        return None
    return put, lambda shape, dtype, sharding: update(core.ShapedArray(shape, dtype), sharding)


_DIRECT = _direct_put()


@dataclass(frozen=True)
class _Assembly:
    """How the arrays of one sharding, shape and box list are put together from their host
    boxes, worked out once for all of them (a state of many arrays has few such kinds)."""

    copies: bool  # boxes held by several devices get device copies (not shared host memory)
    devices: list[Any]  # the addressable devices, in the sharding's order
    box_of_device: tuple[int, ...]  # the box each of them takes
    by_box: dict[Box, int]
    avals: dict[np.dtype, Any] = field(default_factory=dict)  # per dtype: a direct put's


_assemblies: dict[tuple[int, int], tuple[Any, Any, _Assembly]] = {}


def _assembly(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], boxes: tuple[DeviceBox, ...]
) -> _Assembly:
    """_Assembly looked up by the sharding and box objects (kept in the entry, so that
    their ids stay theirs): local_device_boxes gives arrays sharded alike the same boxes."""
    hit = _assemblies.get((id(sharding), id(boxes)))
    if hit is not None and hit[0] is sharding and hit[1] is boxes:
        return hit[2]
    replicated = any(len(devices) > 1 for *_, devices in boxes)
    copies = replicated and not (
        all(d.platform == "cpu" for *_, devices in boxes for d in devices)
        and cpu_donation_keeps_memory()
    )
    by_box = {(start, stop): k for k, (start, stop, _) in enumerate(boxes)}
    indices = sharding.addressable_devices_indices_map(shape)
    made = _Assembly(
        copies,
        list(indices),
        tuple(by_box[slices_to_box(idx, shape)] for idx in indices.values()),  # type: ignore[arg-type]
        by_box,
    )
    if len(_assemblies) >= 4096:
        _assemblies.clear()
    _assemblies[(id(sharding), id(boxes))] = (sharding, boxes, made)
    return made


def array_from_host_boxes(
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    boxes: tuple[DeviceBox, ...],
    hosts: list[np.ndarray],
    dtype: np.dtype | None = None,
) -> jax.Array:
    """The jax.Array on `sharding` whose local shards are the host arrays `hosts`, one per
    box of `boxes` (`local_device_boxes(sharding, shape)`), all of one dtype (`dtype`:
    needed only where this process has no box).

    One batched transfer per array, not a call per shard. On CPU devices a box held by
    several devices is the same host array for each, so they share its memory where that
    is safe (see `cpu_donation_keeps_memory`): a box replicated within the process then
    costs no copy and no memory beyond the one buffer read. Elsewhere the first device gets
    the host bytes and the others copies of them on the devices (`_replicated_on_devices`).

    A sharding with no device of this process (a sub-mesh of other processes' devices) has
    no boxes here: the result is the array with no local shards that every process of a
    multi-controller job holds."""
    if not boxes:
        if dtype is None:
            raise ValueError("an array with no local shards needs its dtype")
        return _without_local_shards(shape, sharding, dtype)
    how = _assembly(sharding, shape, boxes)
    if how.copies:
        return _replicated_on_devices(shape, sharding, boxes, hosts)
    values = [hosts[k] for k in how.box_of_device]
    if _DIRECT is not None and values:
        dtype = values[0].dtype
        aval = how.avals.get(dtype)
        if aval is None and jax.dtypes.canonicalize_dtype(dtype) == dtype:
            aval = how.avals[dtype] = _DIRECT[1](shape, dtype, sharding)
        if aval is not None:
            return _DIRECT[0](aval, sharding, values, how.devices)
    by_box = how.by_box

    def host_of(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is not None  # (shards of jax.Arrays have indices)
        return hosts[by_box[slices_to_box(index, shape)]]

    return jax.make_array_from_callback(shape, sharding, host_of)


def _without_local_shards(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, dtype: np.dtype
) -> jax.Array:
    """The array on `sharding` that this process holds no shard of, of `dtype` as a process
    holding shards gets it (float64 without x64: float32)."""
    if sharding.addressable_devices:
        raise ValueError(f"no host box given for the local devices of {sharding}")
    dtype = jax.dtypes.canonicalize_dtype(dtype)
    return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)


def _replicated_on_devices(
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    boxes: tuple[DeviceBox, ...],
    hosts: list[np.ndarray],
) -> jax.Array:
    """The array from one host-to-device copy per box and device-to-device copies for the
    other devices holding it."""
    per_device: dict[Any, jax.Array] = {}
    for (*_, devices), host in zip(boxes, hosts, strict=True):
        first = jax.device_put(host, devices[0])
        per_device[devices[0]] = first
        per_device.update((d, jax.device_put(first, d)) for d in devices[1:])
    devs = list(sharding.addressable_devices_indices_map(shape))
    return jax.make_array_from_single_device_arrays(shape, sharding, [per_device[d] for d in devs])
