"""Classify the leaves of a tree being saved: arrays (with their layout) or plain values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import dtype_name, little_endian
from ..errors import DeletedArrayError, UnsupportedLeafError
from ..format.manifest import PerProcessLeaf, ValueLeaf
from ..per_process import PerProcess, checked
from ..planning.layout import ArrayLayout, host_layout
from ..tree import Path, path_str
from .iterators import is_data_iterator, iterator_record
from .loaded import is_jax_array

VALUE_TYPES = (bool, int, float, str, bytes, type(None))

MeshSpec = tuple[tuple[str, ...], tuple[int, ...], np.ndarray, list[list[str]]]
"""An array's device mesh and partition spec, for the manifest's compact layouts: mesh axis
names, axis sizes, the process of each mesh position (flat), and per array axis the mesh
axes it is cut over."""


def is_save_leaf(x: Any) -> bool:
    return (
        isinstance(x, (np.ndarray, np.generic, PerProcess, *VALUE_TYPES))
        or is_jax_array(x)
        or is_data_iterator(x)
    )


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


def classify(path: Path, value: Any, process_count: int) -> SaveArray | ValueLeaf:
    name = path_str(path)
    if isinstance(value, PerProcess):
        return PerProcessLeaf(path, checked(value.value, name))
    if is_data_iterator(value):  # a data iterator: its position, per process
        return PerProcessLeaf(path, iterator_record(value, leaf=name))
    if isinstance(value, VALUE_TYPES) and not isinstance(
        value, np.generic
    ):  # np.float64 is a float
        return ValueLeaf(path, value)
    if is_jax_array(value):
        return _jax_save_array(path, name, value)
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


def _jax_save_array(path: Path, name: str, value: Any) -> SaveArray:
    import jax

    from .jax_arrays import describe_sharding, is_prng_key, layout_of

    if value.is_deleted():
        raise DeletedArrayError(
            f"leaf {name!r}: the jax.Array was deleted or donated (e.g. passed to a jitted "
            f"function with donate_argnums) before the save; save the array that replaced it"
        )
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
