"""Lazy arrays computed from stored tensors, and the reads that materialise a box of one.

A `Stored` array is a tensor's bytes in a file. Index transformations (concatenate, slice,
repeat, stack) compose into a `Composite`: a list of pieces, each a child array placed at an
offset and clipped to a window. A piece whose child is stored is exactly a chunk of the
restore executor (its stored box is where the child lands, its box the window), so reading a
shard of a composite reads only the byte runs of the source tensors the shard covers.
Layout transformations (transpose, reshape of a composite, dtype cast) are `Derived`: a box
of the result is computed on the host from one box of the child, read into a scratch buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import dtype_name
from ..errors import TargetMismatchError, UnsupportedLeafError
from ..format import ArrayLeaf, ChunkTable
from ..format.kinds import LeafKind


@dataclass(frozen=True, eq=False)
class VArray:
    """A lazy array: shape and dtype are known, data is read only when a box is asked for."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class Stored(VArray):
    """A tensor stored in C order at byte `offset` of file number `file`."""

    name: str = ""
    file: int = 0
    offset: int = 0


@dataclass(frozen=True, eq=False)
class Unreadable(VArray):
    """A tensor of a dtype snapshard cannot read; asking for it raises `error`."""

    error: str = ""


@dataclass(frozen=True, eq=False)
class Piece:
    """A child placed with its origin at `at`, of which the window [lo, hi) is used."""

    at: tuple[int, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    child: VArray


@dataclass(frozen=True, eq=False)
class Composite(VArray):
    pieces: tuple[Piece, ...] = ()


@dataclass(frozen=True, eq=False)
class Derived(VArray):
    """Computed on the host from a box of `child`: kind is 'transpose', 'reshape' or 'cast'."""

    child: VArray | None = None
    kind: str = ""
    perm: tuple[int, ...] = ()


# ---- building lazy arrays ---------------------------------------------------------------


def _pieces(x: VArray) -> list[Piece]:
    if isinstance(x, Composite):
        return list(x.pieces)
    zero = (0,) * x.ndim
    return [Piece(zero, zero, x.shape, x)]


def _shifted(p: Piece, axis: int, by: int, lo: int, hi: int) -> Piece | None:
    """The piece moved by `by` along axis and clipped to [lo, hi) there; None if empty."""
    a, b = max(p.lo[axis] + by, lo), min(p.hi[axis] + by, hi)
    if a >= b:
        return None

    def put(t: tuple[int, ...], v: int) -> tuple[int, ...]:
        return (*t[:axis], v, *t[axis + 1 :])

    return Piece(put(p.at, p.at[axis] + by), put(p.lo, a), put(p.hi, b), p.child)


def _composite(shape: tuple[int, ...], dtype: np.dtype, pieces: list[Piece]) -> VArray:
    if len(pieces) == 1:
        p = pieces[0]
        if p.lo == (0,) * len(shape) and p.hi == shape and p.child.shape == shape:
            return p.child
    return Composite(shape, dtype, tuple(pieces))


def _axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}: axis {axis} is out of range for {ndim} dimensions")
    return axis % ndim


def concatenate(xs: Sequence[VArray], axis: int, what: str = "concatenate") -> VArray:
    if not xs:
        raise ValueError(f"{what}: nothing to concatenate")
    first = xs[0]
    axis = _axis(axis, first.ndim, what)
    for x in xs[1:]:
        if x.dtype != first.dtype:
            raise TargetMismatchError(f"{what}: dtypes differ ({first.dtype} and {x.dtype})")
        if x.ndim != first.ndim or any(
            a != b for i, (a, b) in enumerate(zip(x.shape, first.shape, strict=True)) if i != axis
        ):
            raise TargetMismatchError(
                f"{what}: shapes {first.shape} and {x.shape} differ off axis {axis}"
            )
    pieces: list[Piece] = []
    offset = 0
    for x in xs:
        n = x.shape[axis]
        pieces += [q for p in _pieces(x) if (q := _shifted(p, axis, offset, offset, offset + n))]
        offset += n
    shape = (*first.shape[:axis], offset, *first.shape[axis + 1 :])
    return _composite(shape, first.dtype, pieces)


def take(x: VArray, axis: int, start: int, stop: int) -> VArray:
    """x[..., start:stop, ...] along axis."""
    axis = _axis(axis, x.ndim, "slice")
    if not 0 <= start <= stop <= x.shape[axis]:
        raise ValueError(f"slice {start}:{stop} is out of range for axis {axis} of {x.shape}")
    pieces = [q for p in _pieces(x) if (q := _shifted(p, axis, -start, 0, stop - start))]
    shape = (*x.shape[:axis], stop - start, *x.shape[axis + 1 :])
    return _composite(shape, x.dtype, pieces)


def repeat(x: VArray, repeats: int, axis: int, block: int = 1) -> VArray:
    """Each block of `block` consecutive entries along axis, repeated `repeats` times in place
    (np.repeat for block=1; repeating attention heads of `block` rows each otherwise)."""
    axis = _axis(axis, x.ndim, "repeat")
    n = x.shape[axis]
    if repeats < 1 or block < 1 or n % block:
        raise ValueError(
            f"repeat: axis {axis} of {x.shape} does not split into blocks of {block}, or repeats={repeats} < 1"
        )
    pieces: list[Piece] = []
    for j in range(n // block * repeats):
        src = j // repeats
        by = (j - src) * block
        pieces += [
            q for p in _pieces(x) if (q := _shifted(p, axis, by, j * block, (j + 1) * block))
        ]
    shape = (*x.shape[:axis], n * repeats, *x.shape[axis + 1 :])
    return _composite(shape, x.dtype, pieces)


def expand_dims(x: VArray, axis: int) -> VArray:
    axis = _axis(axis, x.ndim + 1, "expand_dims")
    shape = (*x.shape[:axis], 1, *x.shape[axis:])

    def ins(t: tuple[int, ...], v: int) -> tuple[int, ...]:
        return (*t[:axis], v, *t[axis:])

    if isinstance(x, Stored):
        return Stored(shape, x.dtype, x.name, x.file, x.offset)
    if isinstance(x, Composite):
        return Composite(
            shape,
            x.dtype,
            tuple(
                Piece(ins(p.at, 0), ins(p.lo, 0), ins(p.hi, 1), expand_dims(p.child, axis))
                for p in x.pieces
            ),
        )
    return Derived(shape, x.dtype, x, "reshape")


def stack(xs: Sequence[VArray], axis: int = 0, what: str = "stack") -> VArray:
    if not xs:
        raise ValueError(f"{what}: nothing to stack")
    return concatenate([expand_dims(x, axis) for x in xs], axis, what)


def transpose(x: VArray, perm: Sequence[int]) -> VArray:
    perm = tuple(int(p) for p in perm)
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"transpose: {perm} is not a permutation of {x.ndim} axes")
    if perm == tuple(range(x.ndim)):
        return x
    shape = tuple(x.shape[p] for p in perm)
    if isinstance(x, Composite):
        # Transposing each piece keeps the pieces apart: a shard reads only its own pieces.
        return Composite(
            shape,
            x.dtype,
            tuple(
                Piece(
                    tuple(p.at[a] for a in perm),
                    tuple(p.lo[a] for a in perm),
                    tuple(p.hi[a] for a in perm),
                    transpose(p.child, perm),
                )
                for p in x.pieces
            ),
        )
    return Derived(shape, x.dtype, x, "transpose", perm)


def reshape(x: VArray, shape: Sequence[int]) -> VArray:
    new = list(shape)
    if new.count(-1) > 1:
        raise ValueError(f"reshape: {tuple(shape)} has more than one -1")
    if -1 in new:
        rest = math.prod(s for s in new if s != -1)
        new[new.index(-1)] = math.prod(x.shape) // rest if rest else 0
    out = tuple(int(s) for s in new)
    if math.prod(out) != math.prod(x.shape) or any(s < 0 for s in out):
        raise ValueError(f"reshape: cannot reshape {x.shape} into {tuple(shape)}")
    if out == x.shape:
        return x
    if isinstance(x, Stored):  # the bytes are the same in C order
        return Stored(out, x.dtype, x.name, x.file, x.offset)
    if isinstance(x, Derived) and x.kind == "reshape":
        assert x.child is not None
        return reshape(x.child, out)
    return Derived(out, x.dtype, x, "reshape")


def cast(x: VArray, dtype: Any) -> VArray:
    dt = np.dtype(dtype)
    if dt == x.dtype:
        return x
    if isinstance(x, Composite):
        return Composite(
            x.shape,
            dt,
            tuple(Piece(p.at, p.lo, p.hi, cast(p.child, dt)) for p in x.pieces),
        )
    return Derived(x.shape, dt, x, "cast")


# ---- the chunk tables the restore executor reads ----------------------------------------


@dataclass
class WindowedChunkTable(ChunkTable):
    """Chunks that store a larger box than the part of the array they provide."""

    stored_starts: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    stored_stops: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))

    stores_own_boxes = False

    def storage_box(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.stored_starts[i], self.stored_stops[i]


def chunk_table(x: VArray) -> WindowedChunkTable:
    """The stored pieces of x as chunks without checksums (block 0)."""
    nd = x.ndim
    rows = [p for p in _pieces(x) if isinstance(p.child, Stored) and math.prod(p.child.shape) > 0]
    if isinstance(x, Derived | Unreadable):
        rows = []

    def box(vals: list[tuple[int, ...]]) -> np.ndarray:
        return np.asarray(vals, dtype=np.int64).reshape(len(rows), nd)

    def col(vals: list[int]) -> np.ndarray:
        return np.asarray(vals, dtype=np.int64).reshape(len(rows))

    stored: list[Stored] = [p.child for p in rows]  # type: ignore[misc]
    return WindowedChunkTable(
        starts=box([p.lo for p in rows]),
        stops=box([p.hi for p in rows]),
        file=col([s.file for s in stored]),
        offset=col([s.offset for s in stored]),
        nbytes=col([s.nbytes for s in stored]),
        block=np.zeros(len(rows), dtype=np.int64),
        crc32c=[""] * len(rows),
        stored_starts=box([p.at for p in rows]),
        stored_stops=box(
            [tuple(a + s for a, s in zip(p.at, p.child.shape, strict=True)) for p in rows]
        ),
    )


def leaf_of(name: str, x: VArray) -> ArrayLeaf:
    """A manifest-like leaf for x, so that the restore executor can read it."""
    if isinstance(x, Unreadable):
        raise UnsupportedLeafError(x.error)
    return ArrayLeaf(
        path=(name,),
        kind=LeafKind.ARRAY,
        dtype=dtype_name(x.dtype, leaf=name),
        shape=x.shape,
        chunks=chunk_table(x),
    )
