"""jax.Array in and out: layouts from shardings, host views of owned shards, arrays from buffers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import numpy as np

from ..planning.layout import ArrayLayout

Index = tuple[slice, ...]


def slices_to_box(index: Index, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    start, stop = [], []
    for s, n in zip(index, shape, strict=True):
        a, b, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {index} is not supported")
        start.append(a)
        stop.append(b)
    return tuple(start), tuple(stop)


@dataclass(frozen=True, eq=False)
class PlacedLayout:
    """A layout and the device of each of its rows."""

    layout: ArrayLayout
    devices: tuple[Any, ...]


@lru_cache(maxsize=4096)
def layout_of(
    shape: tuple[int, ...], itemsize: int, sharding: jax.sharding.Sharding
) -> PlacedLayout:
    """The layout of an array with this shape and sharding; the same object for equal inputs.

    Replica ids number the devices holding the same box in device-id order, the same on
    every process.
    """
    index_map: dict[Any, Index] = dict(sharding.devices_indices_map(shape))
    devices = sorted(index_map, key=lambda d: d.id)
    nd = len(shape)
    starts = np.zeros((len(devices), nd), dtype=np.int64)
    stops = np.zeros((len(devices), nd), dtype=np.int64)
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    replica = np.zeros(len(devices), dtype=np.int64)
    for r, d in enumerate(devices):
        box = slices_to_box(index_map[d], shape)
        starts[r], stops[r] = box
        replica[r] = seen.get(box, 0)
        seen[box] = replica[r] + 1
    process = np.array([d.process_index for d in devices], dtype=np.int64)
    return PlacedLayout(
        ArrayLayout(shape, itemsize, starts, stops, replica, process), tuple(devices)
    )


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


def describe_sharding(sharding: jax.sharding.Sharding) -> dict[str, Any]:
    """A JSON description of a sharding, for people and for `metadata` (never re-imported)."""
    out: dict[str, Any] = {"type": type(sharding).__name__, "num_devices": len(sharding.device_set)}
    if isinstance(sharding, jax.sharding.NamedSharding):
        out["mesh"] = {str(k): int(v) for k, v in sharding.mesh.shape.items()}
        out["spec"] = [
            list(p) if isinstance(p, tuple) else (None if p is None else str(p))
            for p in sharding.spec
        ]
    elif not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        out["repr"] = repr(sharding)[:1000]
    return out


def is_prng_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_dtype_is_prng(dtype: Any) -> bool:
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def local_device_boxes(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...], list[Any]]]:
    """Unique boxes this process must hold for `sharding`, each with its devices."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Any]] = {}
    index_map: dict[Any, Index] = dict(sharding.addressable_devices_indices_map(shape))
    for d, idx in index_map.items():
        groups.setdefault(slices_to_box(idx, shape), []).append(d)
    return [(s, e, sorted(ds, key=lambda d: d.id)) for (s, e), ds in groups.items()]


def to_devices(host: np.ndarray, devices: list[Any]) -> list[jax.Array]:
    """One single-device array per device. The first may share `host`'s memory (CPU); the
    others are copies of it, so that no two devices alias one buffer."""
    first = jax.device_put(host, devices[0])
    return [first] + [jax.device_put(first, d) for d in devices[1:]]


def assemble(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, per_device: dict[Any, jax.Array]
) -> jax.Array:
    devs = list(sharding.addressable_devices_indices_map(shape))
    return jax.make_array_from_single_device_arrays(shape, sharding, [per_device[d] for d in devs])


def mesh_and_spec(
    sharding: Any, ndim: int
) -> tuple[tuple[str, ...], tuple[int, ...], np.ndarray, list[list[str]]] | None:
    """A NamedSharding as (mesh axis names, axis sizes, process of each mesh position, and
    per array axis the mesh axes it is cut over), for the manifest's compact layouts; None
    for other shardings."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    devices = getattr(mesh, "devices", None)
    if devices is None:  # an abstract mesh has no devices
        return None
    processes = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devices).reshape(-1)
    spec: list[list[str]] = []
    for i in range(ndim):
        p = sharding.spec[i] if i < len(sharding.spec) else None
        if p is None:
            spec.append([])
        elif isinstance(p, tuple | list):
            spec.append([str(a) for a in p])
        else:
            spec.append([str(p)])
    return tuple(str(a) for a in mesh.axis_names), tuple(int(s) for s in devices.shape), processes, spec
