"""Classify the leaves of a tree being saved: arrays (with their layout) or plain values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..dtypes import dtype_name, little_endian
from ..errors import UnsupportedLeafError
from ..format.manifest import ValueLeaf
from ..planning.layout import ArrayLayout
from ..tree import Path, path_str
from .jax_arrays import describe_sharding, host_layout, is_prng_key, layout_of, shard_by_device

VALUE_TYPES = (bool, int, float, str, type(None))


def is_save_leaf(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, *VALUE_TYPES))


@dataclass(eq=False)
class SaveArray:
    """An array leaf to be saved: what is stored (dtype, shape) and where its shards live."""

    path: Path
    kind: str  # "array", "scalar" or "prng_key"
    dtype: np.dtype
    shape: tuple[int, ...]
    layout: ArrayLayout
    devices: tuple[Any, ...] | None  # device of each layout row, None for host values
    source: Any  # jax.Array (key data for PRNG keys) or np.ndarray
    sharding: dict[str, Any]
    key_impl: str | None = None

    @property
    def name(self) -> str:
        return path_str(self.path)

    def host_view(
        self, row: int, start: np.ndarray, stop: np.ndarray, shards: dict[Any, Any] | None
    ) -> np.ndarray:
        """A host view of box [start, stop) from the shard on layout row `row`.

        On the CPU backend this is the device buffer itself (no copy); on an accelerator
        np.asarray completes the device-to-host copy started by `start_host_copies`.
        """
        if self.devices is None:
            base = self.source
            origin = np.zeros(len(self.shape), dtype=np.int64)
        else:
            assert shards is not None
            shard = shards[self.devices[row]]
            base = np.asarray(shard.data)
            origin = self.layout.starts[row]
        rel = tuple(
            slice(int(a), int(b)) for a, b in zip(start - origin, stop - origin, strict=True)
        )
        return base[rel]


def classify(path: Path, value: Any, process_count: int) -> SaveArray | ValueLeaf:
    name = path_str(path)
    if isinstance(value, VALUE_TYPES) and not isinstance(
        value, np.generic
    ):  # np.float64 is a float
        return ValueLeaf(path, value)
    if isinstance(value, jax.Array):
        kind, key_impl, data = "array", None, value
        if is_prng_key(value):
            kind, key_impl = "prng_key", str(jax.random.key_impl(value))
            data = jax.random.key_data(value)
        dt = np.dtype(data.dtype)
        dtype_name(dt, leaf=name)
        shape = tuple(int(s) for s in data.shape)
        placed = layout_of(shape, dt.itemsize, data.sharding)
        return SaveArray(
            path,
            kind,
            dt,
            shape,
            placed.layout,
            placed.devices,
            data,
            describe_sharding(data.sharding),
            key_impl,
        )
    if isinstance(value, np.ndarray | np.generic):
        arr = little_endian(np.asarray(value))
        dtype_name(arr.dtype, leaf=name)
        shape = tuple(arr.shape)
        kind = "scalar" if isinstance(value, np.generic) else "array"
        layout = host_layout(shape, arr.dtype.itemsize, process_count)
        return SaveArray(path, kind, arr.dtype, shape, layout, None, arr, {"type": "host"})
    raise UnsupportedLeafError(
        f"leaf {name!r}: values of type {type(value).__module__}.{type(value).__qualname__} cannot be saved"
    )


def start_host_copies(
    arrays: list[SaveArray], rows: list[tuple[int, int]]
) -> dict[int, dict[Any, Any]]:
    """Start every needed device-to-host copy at once; returns the shard map of each array."""
    shards: dict[int, dict[Any, Any]] = {}
    for a, row in rows:
        arr = arrays[a]
        if arr.devices is None:
            continue
        if a not in shards:
            shards[a] = shard_by_device(arr.source)
        shards[a][arr.devices[row]].data.copy_to_host_async()
    return shards
