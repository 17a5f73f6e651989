"""Classify the leaves of a tree being saved: arrays (with their layout) or plain values.

Shared by every wing: NumPy arrays, Python values, per-process values and data iterators
are classified here; a jax.Array by the JAX wing (`frameworks.jax_wing().save_array`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..dtypes import dtype_name, little_endian
from ..errors import UnsupportedLeafError
from ..format.kinds import LeafKind
from ..format.leaves import PerProcessLeaf, ValueLeaf
from ..frameworks import is_jax_array, jax_wing
from ..iterators import is_data_iterator, iterator_record
from ..per_process import PerProcess, checked
from ..planning.layout import ArrayLayout, host_layout
from ..tree import Path, path_str

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
    kind: LeafKind  # ARRAY, SCALAR or PRNG_KEY
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

    def __getstate__(self) -> dict[str, Any]:
        """What a writer process gets (saving/writer_main.py): the description, never the
        framework's array or devices (whether it had devices stays known)."""
        state = dict(self.__dict__)
        state["source"] = None
        state["devices"] = None if self.devices is None else ()
        return state


def classify(path: Path, value: Any, process_count: int) -> SaveArray | ValueLeaf:
    name = path_str(path)
    if is_jax_array(value):  # first: most leaves of a training state
        return _named(jax_wing().save_array(path, name, value), name)
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
        kind = LeafKind.SCALAR if isinstance(value, np.generic) else LeafKind.ARRAY
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
