"""DTensor sharding as an ArrayLayout, computed from metadata alone (no torch import, no RPC).

A DTensor's placement on a DeviceMesh is fully described by the global shape, the mesh's
rank tensor (mesh coordinate → global rank) and one placement per mesh dimension:

- ``Shard(d)``: dimension d (as sharded so far) is cut into ``mesh_shape[m]`` pieces with
  ``torch.chunk`` semantics: pieces of ``ceil(n / k)``, the last ones shorter or empty;
- ``_StridedShard(d, split_factor=f)`` (FSDP2 on top of tensor parallel): the dimension is
  first cut into f pieces, each piece into ``mesh_shape[m]`` pieces, and a rank takes its
  piece of every one of the f (so its indices may not be contiguous);
- ``Replicate()``: every coordinate of the mesh dimension holds the same data.

Every rank runs the same function over the same metadata and gets every rank's boxes, so
the write planner needs nothing from anyone. A rank whose indices on a dimension are several
runs (possible with ``_StridedShard``) gets one layout row per combination of runs; each row
records where its box sits in the rank's local tensor.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from ..planning.layout import ArrayLayout

Runs = tuple[tuple[int, int], ...]  # [start, stop) ranges of a dimension, in local order


@dataclass(frozen=True)
class ShardSpec:
    """``Shard(dim)`` (split_factor 1) or ``_StridedShard(dim, split_factor)``."""

    dim: int
    split_factor: int = 1


# One entry per mesh dimension: a ShardSpec, or None for Replicate.
PlacementSpec = ShardSpec | None


@dataclass(frozen=True, eq=False)
class TensorLayout:
    """The layout of one DTensor and, per row, where its box starts in the local tensor."""

    layout: ArrayLayout
    local_starts: np.ndarray  # (rows, ndim)
    # per rank, its rows and local shape (layouts are cached and shared: computed once)
    _memo: dict[tuple[str, int], Any] = field(default_factory=dict, repr=False)

    def rows_of(self, rank: int) -> np.ndarray:
        rows = self._memo.get(("rows", rank))
        if rows is None:
            rows = np.flatnonzero(self.layout.process_ids == rank)
            rows.setflags(write=False)
            self._memo[("rows", rank)] = rows
        return rows

    def boxes_of(self, rank: int) -> list[tuple[np.ndarray, np.ndarray, tuple[slice, ...] | None]]:
        """(global start, stop, slices of the local tensor) of every box of some elements
        `rank` holds; slices None where the box is the whole local tensor."""
        out = self._memo.get(("boxes", rank))
        if out is None:
            lay, shape = self.layout, self.local_shape(rank)
            out = []
            for row in self.rows_of(rank):
                s, e, o = lay.starts[row], lay.stops[row], self.local_starts[row]
                if np.any(e <= s):
                    continue
                whole = not np.any(o) and tuple(int(x) for x in e - s) == shape
                slc = tuple(slice(int(a), int(a + b - c)) for a, b, c in zip(o, e, s, strict=True))
                out.append((s, e, None if whole else slc))
            self._memo[("boxes", rank)] = out
        return out

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of `rank`'s local tensor (its rows' boxes put side by side)."""
        shape = self._memo.get(("shape", rank))
        if shape is None:
            rows = self.rows_of(rank)
            shape = ()
            if len(rows):
                lay = self.layout
                ends = self.local_starts[rows] + (lay.stops[rows] - lay.starts[rows])
                shape = tuple(int(x) for x in ends.max(axis=0))
            self._memo[("shape", rank)] = shape
        return shape


def _take(runs: Runs, lo: int, hi: int) -> Runs:
    """Positions [lo, hi) of the index sequence the runs spell."""
    out = []
    pos = 0
    for a, b in runs:
        n = b - a
        s, e = max(lo - pos, 0), min(hi - pos, n)
        if s < e:
            out.append((a + s, a + e))
        pos += n
    return tuple(out)


def _length(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


def _chunk(runs: Runs, k: int, i: int) -> Runs:
    """Piece i of k, as torch.chunk cuts (pieces of ceil(n / k), trailing ones may be empty)."""
    n = _length(runs)
    size = -(-n // k) if k else n
    lo = min(i * size, n)
    return _take(runs, lo, min(lo + size, n))


def _merge(runs: Runs) -> Runs:
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def dim_runs(size: int, steps: Sequence[tuple[int, int, int]]) -> Runs:
    """The indices of one tensor dimension a rank holds after `steps` of (pieces, own piece,
    split factor), applied in mesh-dimension order."""
    runs: Runs = ((0, size),) if size else ()
    for k, i, f in steps:
        if f <= 1:
            runs = _chunk(runs, k, i)
        else:
            n = _length(runs)
            first = -(-n // f) if f else n
            parts = [_take(runs, min(j * first, n), min((j + 1) * first, n)) for j in range(f)]
            runs = tuple(r for p in parts for r in _chunk(p, k, i))
        runs = _merge(runs)
    return runs


def normalize(placements: Sequence[PlacementSpec], ndim: int) -> tuple[PlacementSpec, ...]:
    out: list[PlacementSpec] = []
    for p in placements:
        if p is None:
            out.append(None)
            continue
        d = p.dim + ndim if p.dim < 0 else p.dim
        if not 0 <= d < ndim:
            raise ValueError(f"placement shards dimension {p.dim} of a {ndim}-d tensor")
        if p.split_factor < 1:
            raise ValueError(f"split factor {p.split_factor} must be at least 1")
        out.append(ShardSpec(d, int(p.split_factor)))
    return tuple(out)


def tensor_layout(
    shape: Sequence[int],
    itemsize: int,
    mesh_ranks: np.ndarray,
    placements: Sequence[PlacementSpec],
) -> TensorLayout:
    """Every rank's boxes of a tensor of `shape` placed on the mesh whose coordinate c is
    global rank ``mesh_ranks[c]``. Cached: equal inputs give the same object."""
    ranks = np.asarray(mesh_ranks, dtype=np.int64)
    if ranks.ndim != len(placements):
        raise ValueError(f"{len(placements)} placement(s) for a mesh of {ranks.ndim} dimension(s)")
    shp = tuple(int(s) for s in shape)
    specs = normalize(placements, len(shp))
    return _cached(shp, int(itemsize), ranks.shape, ranks.tobytes(), specs)


@lru_cache(maxsize=4096)
def _cached(
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
    ranks_bytes: bytes,
    specs: tuple[PlacementSpec, ...],
) -> TensorLayout:
    ranks = np.frombuffer(ranks_bytes, dtype=np.int64).reshape(mesh_shape)
    nd = len(shape)
    coords = np.indices(mesh_shape).reshape(len(mesh_shape), -1).T  # row-major mesh order
    flat_ranks = ranks.reshape(-1)
    # Per tensor dimension: the mesh dimensions that shard it, in order; a rank's indices on
    # that dimension depend on its coordinates along those alone.
    shard_dims = [
        [m for m, p in enumerate(specs) if p is not None and p.dim == d] for d in range(nd)
    ]
    tables = [_dim_tables(shape[d], mesh_shape, shard_dims[d], specs) for d in range(nd)]
    starts: list[list[int]] = []
    stops: list[list[int]] = []
    local: list[list[int]] = []
    procs: list[int] = []
    sets: list[tuple[Runs, ...]] = []
    rank_of_row: list[int] = []
    for r, c in enumerate(coords):
        per_dim = tuple(tables[d][tuple(int(c[m]) for m in shard_dims[d])] for d in range(nd))
        sets.append(per_dim)
        for start, stop, origin in _boxes_of(shape, per_dim):
            starts.append(start)
            stops.append(stop)
            local.append(origin)
            procs.append(int(flat_ranks[r]))
            rank_of_row.append(r)
    # Replica ids: coordinates holding identical index sets, numbered in mesh order.
    seen: dict[tuple[Runs, ...], int] = {}
    replica_of_coord = []
    for s in sets:
        replica_of_coord.append(seen.get(s, 0))
        seen[s] = replica_of_coord[-1] + 1
    replicas = [replica_of_coord[r] for r in rank_of_row]
    n = len(procs)
    layout = ArrayLayout(
        shape,
        itemsize,
        np.asarray(starts, dtype=np.int64).reshape(n, nd),
        np.asarray(stops, dtype=np.int64).reshape(n, nd),
        np.asarray(replicas, dtype=np.int64),
        np.asarray(procs, dtype=np.int64),
    )
    return TensorLayout(layout, np.asarray(local, dtype=np.int64).reshape(n, nd))


def _dim_tables(
    size: int, mesh_shape: tuple[int, ...], dims: list[int], specs: tuple[PlacementSpec, ...]
) -> dict[tuple[int, ...], Runs]:
    """The index runs of one tensor dimension of `size`, per coordinate combination along
    the mesh dimensions `dims` that shard it."""
    table: dict[tuple[int, ...], Runs] = {}
    for combo in np.ndindex(*[mesh_shape[m] for m in dims]):
        steps = [
            (mesh_shape[m], int(c), specs[m].split_factor)  # type: ignore[union-attr]
            for m, c in zip(dims, combo, strict=True)
        ]
        table[tuple(int(c) for c in combo)] = dim_runs(size, steps)
    return table


def _boxes_of(
    shape: tuple[int, ...], per_dim: tuple[Runs, ...]
) -> list[tuple[list[int], list[int], list[int]]]:
    """(start, stop, local offset) of every box a rank holding the runs `per_dim` holds:
    one per combination of a run of each dimension, placed in the local tensor in order."""
    nd = len(shape)
    # Empty dimension: one empty row, at the offset torch reports (the dimension's size).
    choices = [runs if runs else ((shape[d], shape[d]),) for d, runs in enumerate(per_dim)]
    origins = [
        list(itertools.accumulate((b - a for a, b in runs[:-1]), initial=0)) for runs in choices
    ]
    return [
        (
            [choices[d][j][0] for d, j in enumerate(pick)],
            [choices[d][j][1] for d, j in enumerate(pick)],
            [origins[d][j] for d, j in enumerate(pick)],
        )
        for pick in (np.ndindex(*[len(x) for x in choices]) if nd else [()])
    ]


def local_shape_and_offset(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[PlacementSpec],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What DTensor's compute_local_shape_and_global_offset reports for one coordinate: the
    local shape and the first global index on each dimension (its size if empty)."""
    ranks = np.arange(math.prod(mesh_shape), dtype=np.int64).reshape(tuple(mesh_shape))
    tl = tensor_layout(shape, 1, ranks, placements)
    rank = int(ranks[tuple(coord)])
    rows = tl.rows_of(rank)
    lay = tl.layout
    first = rows[np.lexsort(tl.local_starts[rows].T[::-1])[0]] if len(shape) else rows[0]
    return tl.local_shape(rank) if len(shape) else (), tuple(int(x) for x in lay.starts[first])


def expand_submesh(root_ranks: np.ndarray, sub_ranks: np.ndarray) -> np.ndarray:
    """The rank tensor of every copy of a sub-mesh in its root mesh, stacked on a new first
    axis: shape (copies, *sub_ranks.shape).

    A sub-mesh (``mesh["dp"]``, or a flattened ``mesh["dp", "cp"]._flatten()``) spans some
    root dimensions; the other root dimensions index its copies, which hold the same data
    (DTensor semantics: the tensor is replicated over them). Raises ValueError when
    `sub_ranks` is not such a slice of `root_ranks`.
    """
    root = np.asarray(root_ranks, dtype=np.int64)
    sub = np.asarray(sub_ranks, dtype=np.int64)
    same_ranks = np.array_equal(np.sort(sub.reshape(-1)), np.sort(root.reshape(-1)))
    if sub.size == root.size and sub.size and same_ranks:
        return sub[None]
    where = {int(r): i for i, r in enumerate(root.reshape(-1))}
    try:
        flat = np.array([where[int(r)] for r in sub.reshape(-1)], dtype=np.int64)
    except KeyError:
        raise ValueError("the mesh holds ranks that its root mesh does not") from None
    coords = np.stack(np.unravel_index(flat, root.shape), axis=-1).reshape(*sub.shape, root.ndim)
    spans: list[list[int]] = []
    for i in range(sub.ndim):
        moved = np.moveaxis(coords, i, 0)
        varying = [a for a in range(root.ndim) if not np.all(moved[..., a] == moved[:1, ..., a])]
        spans.append(varying)
    used = [a for s in spans for a in s]
    if len(used) != len(set(used)):
        raise ValueError("the mesh is not a slice of its root mesh")
    others = [a for a in range(root.ndim) if a not in used]
    groups = np.transpose(root, others + used).reshape(-1, *sub.shape)
    match = np.flatnonzero(np.all(groups.reshape(len(groups), -1) == sub.reshape(1, -1), axis=1))
    if len(match) != 1:
        raise ValueError("the mesh is not a slice of its root mesh")
    return groups
