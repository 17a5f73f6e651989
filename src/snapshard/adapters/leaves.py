"""Classify the leaves of a tree being saved: arrays (with their layout) or plain values."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
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

    @cached_property
    def name(self) -> str:  # asked per chunk of the array: made once
        return path_str(self.path)


def classify(path: Path, value: Any, process_count: int) -> SaveArray | ValueLeaf:
    name = path_str(path)
    if is_jax_array(value):  # first: most leaves of a training state
        return _named(_jax_save_array(path, name, value), name)
    if isinstance(value, PerProcess):
        return PerProcessLeaf(path, checked(value.value, name))
    if is_data_iterator(value):  # a data iterator: its position, per process
        return PerProcessLeaf(path, iterator_record(value, leaf=name))
    if isinstance(value, VALUE_TYPES) and not isinstance(
        value, np.generic
    ):  # np.float64 is a float
        return ValueLeaf(path, value)
    if isinstance(value, np.ndarray | np.generic):
        arr = little_endian(np.asarray(value))
        checked_dtype(arr.dtype, name)
        shape = tuple(arr.shape)
        kind = "scalar" if isinstance(value, np.generic) else "array"
        layout = host_layout(shape, arr.dtype.itemsize, process_count)
        saved = SaveArray(path, kind, arr.dtype, shape, layout, None, arr, {"type": "host"})
        return _named(saved, name)
    raise UnsupportedLeafError(
        f"leaf {name!r}: values of type {type(value).__module__}.{type(value).__qualname__} cannot be saved"
    )


def _named(arr: SaveArray, name: str) -> SaveArray:
    """`arr` with its name (a cached property) already known."""
    arr.__dict__["name"] = name
    return arr


# Per dtype, its stored name once checked (dtype_name costs ~5 us, asked per leaf).
_DTYPE_NAMES: dict[np.dtype, str] = {}


def checked_dtype(dt: np.dtype, leaf: str) -> str:
    """The stored name of `dt` (dtypes.dtype_name, which raises naming `leaf`), cached."""
    name = _DTYPE_NAMES.get(dt)
    if name is None:
        name = dtype_name(dt, leaf=leaf)
        if len(_DTYPE_NAMES) < 256:
            _DTYPE_NAMES[dt] = name
    return name


# Per sharding, its JSON description (shared by the leaves that have it: never mutated).
_SHARDINGS: dict[Any, dict[str, Any]] = {}


def _sharding_description(sharding: Any) -> dict[str, Any]:
    from .jax_arrays import describe_sharding

    found = _SHARDINGS.get(sharding)
    if found is None:
        found = describe_sharding(sharding)
        if len(_SHARDINGS) >= 4096:
            _SHARDINGS.clear()
        _SHARDINGS[sharding] = found
    return found


# Per (dtype, shape, sharding) of a jax.Array that is not a key: its stored dtype and shape,
# placed layout and sharding description (arrays alike are most of a training state).
_PLACED: dict[tuple[Any, ...], tuple[np.dtype, tuple[int, ...], Any, dict[str, Any]]] = {}


def _jax_save_array(path: Path, name: str, value: Any) -> SaveArray:
    from .jax_arrays import is_prng_key, layout_of

    if value.is_deleted():
        raise DeletedArrayError(
            f"leaf {name!r}: the jax.Array was deleted or donated (e.g. passed to a jitted "
            f"function with donate_argnums) before the save; save the array that replaced it"
        )
    known = _PLACED.get((value.dtype, value.shape, value.sharding))
    if known is not None:  # an array like one met before: what follows from the three
        dt, shape, placed, described = known
        return SaveArray(path, "array", dt, shape, placed.layout, placed.devices, value, described)
    kind, key_impl, data = "array", None, value
    if is_prng_key(value):
        import jax

        kind, key_impl = "prng_key", str(jax.random.key_impl(value))
        data = jax.random.key_data(value)
    dt = np.dtype(data.dtype)
    checked_dtype(dt, name)
    shape = tuple(int(s) for s in data.shape)
    sharding = data.sharding
    placed = layout_of(shape, dt.itemsize, sharding)
    if kind == "array":
        if len(_PLACED) >= 4096:
            _PLACED.clear()
        _PLACED[(value.dtype, value.shape, sharding)] = (
            dt,
            shape,
            placed,
            _sharding_description(sharding),
        )
    return SaveArray(
        path,
        kind,
        dt,
        shape,
        placed.layout,
        placed.devices,
        data,
        _sharding_description(sharding),
        key_impl,
    )
