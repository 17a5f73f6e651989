"""The leaves of a manifest (arrays, values, per-process values) and their JSON form."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ..dtypes import NAME_TO_DTYPE, dtype_from_name
from ..errors import CorruptCheckpointError
from ..tree import Path, path_str
from .bounds import MAX_BYTES, MAX_DIM, MAX_NDIM, MAX_PROCESSES, bounded_int
from .chunks import ChunkTable
from .kinds import ARRAY_KINDS, LeafKind
from .values import decode_value, encode_value

# The chunks of a leaf until its table is known (v2: fetched later; shared, never changed).
_NO_CHUNKS = ChunkTable.empty(0)


@dataclass
class ArrayLeaf:
    """An array leaf: a jax.Array, np.ndarray, NumPy scalar ('scalar') or typed PRNG key.

    v2: `layout` numbers the manifest's layout descriptions; `writers`, when present, are
    the only processes that wrote chunks of it (listed where the holders are many)."""

    path: Path
    kind: str
    dtype: str
    shape: tuple[int, ...]
    sharding: dict[str, Any] | None = None
    key_impl: str | None = None
    chunks: ChunkTable = field(default_factory=lambda: _NO_CHUNKS)
    layout: int | None = None
    writers: tuple[int, ...] | None = None
    chunk_count: int | None = None  # v2: the number of chunks, known without the records

    @property
    def num_chunks(self) -> int:
        return self.chunk_count if self.chunk_count is not None else len(self.chunks)

    @cached_property
    def name(self) -> str:  # (asked per box and per error of a restore: made once)
        return path_str(self.path)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The shape the user sees (a key array's stored shape has the key data axis)."""
        return self.shape[:-1] if self.kind == LeafKind.PRNG_KEY else self.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclass
class ValueLeaf:
    """A Python value stored in the manifest itself: int, float, bool, str, bytes or None."""

    path: Path
    value: Any

    @cached_property
    def name(self) -> str:  # (asked per box and per error of a restore: made once)
        return path_str(self.path)


@dataclass
class PerProcessLeaf(ValueLeaf):
    """v2: a value each process saved for itself (snapshard.PerProcess), kept in that
    process's values file; `value` is filled in by a restore (None until then)."""


Leaf = ArrayLeaf | ValueLeaf


KEY_TYPES = frozenset((str, int))  # a path's keys (not bool: type() is exact)
_INT = frozenset((int,))


def _path_from_json(p: Any, where: str) -> Path:
    if type(p) is not list or not KEY_TYPES.issuperset(map(type, p)):
        raise CorruptCheckpointError(f"{where}: malformed leaf path {str(p)[:200]}")
    return tuple(p)


def leaf_to_json(leaf: Leaf) -> dict[str, Any]:
    if isinstance(leaf, PerProcessLeaf):
        return {"path": list(leaf.path), "kind": LeafKind.PER_PROCESS}
    if isinstance(leaf, ValueLeaf):
        return {
            "path": list(leaf.path),
            "kind": LeafKind.VALUE,
            "value": encode_value(leaf.value, leaf.name),
        }
    out: dict[str, Any] = {
        "path": list(leaf.path),
        "kind": leaf.kind,
        "dtype": leaf.dtype,
        "shape": list(leaf.shape),
        "sharding": leaf.sharding,
    }
    if leaf.key_impl is not None:
        out["key_impl"] = leaf.key_impl
    if leaf.layout is not None:
        out["layout"] = leaf.layout
    if leaf.writers is not None:
        out["writers"] = list(leaf.writers)
    if leaf.chunk_count is not None:
        out["chunk_count"] = leaf.chunk_count
    return out


def leaf_from_json(
    d: Any, where: str, version: int, shardings: dict[str, Any] | None = None
) -> Leaf:
    """A leaf entry of the manifest, checked. `shardings`: descriptions already seen, by
    their text, so that equal ones share one object (a state has many arrays, few kinds
    of sharding: at 10,000 DTensors, 3.5 MiB of dicts)."""
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"{where}: malformed leaf entry")
    path = _path_from_json(d.get("path"), where)
    kind = d.get("kind")
    manifest = where

    def at() -> str:  # (made only for an error: a manifest may list 100,000 leaves)
        return f"{manifest}, leaf {path_str(path)!r}"

    def number(x: Any, lo: int, hi: int, what: str) -> int:
        ok = type(x) is int and lo <= x <= hi
        return x if ok else bounded_int(x, lo, hi, what, at())

    if kind == LeafKind.VALUE:
        return ValueLeaf(path, decode_value(d.get("value"), at()))
    if kind == LeafKind.PER_PROCESS and version >= 2:
        return PerProcessLeaf(path, None)
    if not isinstance(kind, str) or kind not in ARRAY_KINDS:
        raise CorruptCheckpointError(f"{at()}: unknown leaf kind {str(kind)[:100]!r}")
    shape = d.get("shape")
    if (
        type(shape) is not list
        or len(shape) > MAX_NDIM
        or not _INT.issuperset(map(type, shape))
        or (shape and not (min(shape) >= 0 and max(shape) <= MAX_DIM))
        or math.prod(shape) > MAX_BYTES
    ):
        raise CorruptCheckpointError(f"{at()}: malformed shape {str(shape)[:200]}")
    dtype = d.get("dtype")
    if not isinstance(dtype, str) or dtype not in NAME_TO_DTYPE:
        raise CorruptCheckpointError(f"{at()}: unknown dtype {str(dtype)[:100]!r}")
    key_impl = d.get("key_impl")
    if key_impl is not None and not isinstance(key_impl, str):
        raise CorruptCheckpointError(f"{at()}: malformed key_impl")
    sharding = d.get("sharding")
    if not isinstance(sharding, dict):
        sharding = None
    elif shardings is not None:
        sharding = shardings.setdefault(repr(sharding), sharding)
    leaf = ArrayLeaf(
        path=path,
        kind=kind,
        dtype=dtype,
        shape=tuple(shape),
        sharding=sharding,
        key_impl=key_impl,
    )
    if version == 1:
        rows = d.get("chunks", [])
        if not isinstance(rows, list):
            raise CorruptCheckpointError(f"{at()}: malformed chunk list")
        leaf.chunks = ChunkTable.from_rows(rows, len(shape), at())
        return leaf
    leaf.layout = number(d.get("layout"), 0, 1 << 31, "layout number")
    leaf.chunk_count = number(d.get("chunk_count"), 0, MAX_BYTES, "chunk count")
    writers = d.get("writers")
    if writers is not None:
        if not isinstance(writers, list) or len(writers) > MAX_PROCESSES:
            raise CorruptCheckpointError(f"{at()}: malformed writer list")
        leaf.writers = tuple(number(w, 0, MAX_PROCESSES, "writer") for w in writers)
    return leaf


def interned(leaves: list[Leaf]) -> list[Leaf]:
    """v1: share the box columns of chunk tables with equal boxes (format.chunks)."""
    seen: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
    for leaf in leaves:
        if isinstance(leaf, ArrayLeaf) and len(leaf.chunks):
            leaf.chunks.intern_boxes(seen)
    return leaves
