"""Format v2: compact descriptions of where an array's saved boxes lived, and who held them.

A reader uses them to know which processes may have written the chunks its boxes overlap
(`Holders`, narrowed by the leaf's `writers` where listed), so that it fetches those
processes' records and nobody else's. One description per distinct layout, never one row
per device of every array:

- ``{"kind": "mesh", "mesh": m, "spec": [[axis, ...] | [], ...]}``: a named sharding over
  mesh `m` of the manifest's ``meshes`` (axis names, axis sizes and the process of every
  mesh position). Array axis i is cut evenly into the product of the sizes of its mesh
  axes (major to minor); a box is held by the processes of every mesh position mapping to it.
- ``{"kind": "rows", "rows": <base64 zlib int64 (devices, 2·ndim + 1)>}``: each device's
  box start, stop and process, for any other sharding.
- ``{"kind": "host"}``: every process held all of the array (NumPy and Python values).

Pure: no I/O, no JAX.
"""

from __future__ import annotations

import base64
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from ..planning.layout import ArrayLayout, ShardGroups
from ..planning.overlaps import ChunkIndex
from .leaves import ArrayLeaf
from .manifest import Manifest

# Bounds a reader enforces before allocating anything a description implies.
MAX_DEVICES = 1 << 22
MAX_NDIM = 64


def pack_ints(a: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a, "<i8").tobytes(), 6)).decode()


def unpack_ints(text: Any, count: int, where: str) -> np.ndarray:
    if not isinstance(text, str) or count < 0 or count > MAX_DEVICES * (2 * MAX_NDIM + 1):
        raise CorruptCheckpointError(f"{where}: malformed packed integers")
    try:
        raw = zlib.decompressobj().decompress(base64.b64decode(text, validate=True), 8 * count + 1)
    except (ValueError, zlib.error) as e:
        raise CorruptCheckpointError(f"{where}: malformed packed integers ({e})") from None
    if len(raw) != 8 * count:
        raise CorruptCheckpointError(
            f"{where}: packed integers hold {len(raw) // 8}, expected {count}"
        )
    return np.frombuffer(raw, "<i8").astype(np.int64)


@dataclass(frozen=True)
class Mesh:
    """Axis names and sizes, and the process of every mesh position (C order)."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    processes: np.ndarray

    def to_json(self) -> dict[str, Any]:
        return {
            "axes": list(self.axes),
            "shape": list(self.shape),
            "processes": pack_ints(self.processes),
        }

    @staticmethod
    def from_json(d: Any, where: str) -> Mesh:
        try:
            axes = tuple(str(a) for a in d["axes"])
            shape = tuple(int(s) for s in d["shape"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{where}: malformed mesh") from None
        if len(axes) != len(shape) or len(set(axes)) != len(axes) or any(s < 1 for s in shape):
            raise CorruptCheckpointError(f"{where}: malformed mesh axes {list(axes)} {list(shape)}")
        n = math.prod(shape)
        if n > MAX_DEVICES:
            raise CorruptCheckpointError(f"{where}: mesh of {n} devices is too large")
        return Mesh(axes, shape, unpack_ints(d.get("processes"), n, where))

    @cached_property
    def key(self) -> tuple[Any, ...]:
        """A hashable identity, made once per mesh: the committer looks it up for every leaf,
        and remaking it copies and hashes one integer per device each time."""
        return (self.axes, self.shape, self.processes.tobytes())


def mesh_layout(
    mesh: Mesh, spec: list[list[str]], shape: tuple[int, ...], itemsize: int, where: str
) -> ArrayLayout:
    """The layout (one row per mesh position) of an array sharded over `mesh` by `spec`."""
    nd = len(shape)
    if len(spec) != nd:
        raise CorruptCheckpointError(f"{where}: layout spec has {len(spec)} axes, the array {nd}")
    used = [a for axes in spec for a in axes]
    if len(set(used)) != len(used) or any(a not in mesh.axes for a in used):
        raise CorruptCheckpointError(
            f"{where}: layout spec {spec} does not fit mesh {list(mesh.axes)}"
        )
    coords = np.indices(mesh.shape, dtype=np.int64).reshape(len(mesh.shape), -1)
    size = dict(zip(mesh.axes, mesh.shape, strict=True))
    starts = np.zeros((coords.shape[1], nd), np.int64)
    stops = np.zeros_like(starts)
    for i, axes in enumerate(spec):
        parts = math.prod(size[a] for a in axes)
        if shape[i] % parts:
            raise CorruptCheckpointError(
                f"{where}: axis {i} of size {shape[i]} is not divisible into {parts} shards"
            )
        k = np.zeros(coords.shape[1], np.int64)
        for a in axes:
            k = k * size[a] + coords[mesh.axes.index(a)]
        step = shape[i] // parts
        starts[:, i], stops[:, i] = k * step, (k + 1) * step
    rows = len(mesh.processes)
    return ArrayLayout(shape, itemsize, starts, stops, np.zeros(rows, np.int64), mesh.processes)


def rows_layout(
    text: Any, shape: tuple[int, ...], itemsize: int, devices: Any, where: str
) -> ArrayLayout:
    nd = len(shape)
    if not isinstance(devices, int) or not 0 < devices <= MAX_DEVICES:
        raise CorruptCheckpointError(f"{where}: malformed device count {devices!r}")
    a = unpack_ints(text, devices * (2 * nd + 1), where).reshape(devices, 2 * nd + 1)
    starts, stops = a[:, :nd], a[:, nd : 2 * nd]
    if np.any(starts < 0) or np.any(stops > np.asarray(shape, np.int64)) or np.any(stops < starts):
        raise CorruptCheckpointError(f"{where}: layout rows outside the array")
    if np.any(a[:, -1] < 0):
        raise CorruptCheckpointError(f"{where}: layout rows name a negative process")
    return ArrayLayout(shape, itemsize, starts, stops, np.zeros(devices, np.int64), a[:, -1])


def host_holders(shape: tuple[int, ...], itemsize: int, process_count: int) -> ArrayLayout:
    nd = len(shape)
    n = process_count
    return ArrayLayout(
        shape, itemsize, np.zeros((n, nd), np.int64), np.tile(np.asarray(shape, np.int64), (n, 1)),
        np.arange(n), np.arange(n),
    )  # fmt: skip


def describe_rows(layout: ArrayLayout) -> dict[str, Any]:
    rows = np.concatenate([layout.starts, layout.stops, layout.process_ids[:, None]], axis=1)
    return {"kind": "rows", "devices": len(rows), "rows": pack_ints(rows)}


def same_holders(a: ShardGroups, b: ShardGroups) -> bool:
    """Whether two layouts have the same unique boxes, each held by the same processes."""
    if a.count != b.count or not (
        np.array_equal(a.starts, b.starts) and np.array_equal(a.stops, b.stops)
    ):
        return False

    def held(g: ShardGroups) -> np.ndarray:
        pairs = np.stack([g.cand_box, g.cand_process], axis=1)
        return np.unique(pairs, axis=0)

    return np.array_equal(held(a), held(b))


BoundsArrays = tuple[np.ndarray, np.ndarray]  # a box as (start, stop) arrays


@dataclass
class Holders:
    """Who held the saved boxes of a manifest's arrays, from their layout descriptions, worked
    out once per layout and shape (`url`: the checkpoint's, for errors)."""

    manifest: Manifest
    url: str
    _indexes: dict[tuple[Any, ...], tuple[ShardGroups, ChunkIndex]] = field(default_factory=dict)
    _grids: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray] | None] = field(
        default_factory=dict
    )
    _meshes: dict[int, Mesh] = field(default_factory=dict)

    def _layout(self, leaf: ArrayLeaf) -> ArrayLayout:
        m = self.manifest
        where = f"{self.url}, leaf {leaf.name!r}"
        if leaf.layout is None or not 0 <= leaf.layout < len(m.layouts):
            raise CorruptCheckpointError(f"{where}: layout {leaf.layout} is not in the manifest")
        d = m.layouts[leaf.layout]
        kind = d.get("kind")
        if kind == "host":
            return host_holders(leaf.shape, 1, m.process_count)
        if kind == "rows":
            lay = rows_layout(d.get("rows"), leaf.shape, 1, d.get("devices"), where)
        elif kind == "mesh":
            mid = d.get("mesh")
            if not isinstance(mid, int) or not 0 <= mid < len(m.meshes):
                raise CorruptCheckpointError(
                    f"{where}: layout names mesh {mid!r}, not in the manifest"
                )
            if mid not in self._meshes:
                self._meshes[mid] = Mesh.from_json(m.meshes[mid], where)
            spec = d.get("spec")
            if not isinstance(spec, list) or not all(
                isinstance(s, list) and all(isinstance(a, str) for a in s) for s in spec
            ):
                raise CorruptCheckpointError(f"{where}: malformed layout spec")
            lay = mesh_layout(self._meshes[mid], spec, leaf.shape, 1, where)
        else:
            raise CorruptCheckpointError(f"{where}: unknown layout kind {str(kind)[:50]!r}")
        if int(lay.process_ids.max()) >= m.process_count:
            raise CorruptCheckpointError(
                f"{where}: layout names a process beyond {m.process_count}"
            )
        return lay

    def groups(self, leaf: ArrayLeaf) -> ShardGroups:
        """The saved boxes of the array and the processes that held each."""
        return self._indexed(leaf)[0]

    def _indexed(self, leaf: ArrayLeaf) -> tuple[ShardGroups, ChunkIndex]:
        key = (leaf.layout, leaf.shape)
        h = self._indexes.get(key)
        if h is None:
            groups = self._layout(leaf).shards
            h = self._indexes[key] = (groups, ChunkIndex(groups.starts, groups.stops))
        return h

    def _mesh_grid(self, leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
        """For a mesh layout: the process of every mesh position arranged as (pieces of array
        axis 0, pieces of axis 1, …, the other mesh axes), and each axis's piece length;
        None for other layouts. Holders of a box are then one block of it, with no per-device
        rows built."""
        key = (leaf.layout, leaf.shape)
        if key in self._grids:
            return self._grids[key]
        d = self.manifest.layouts[leaf.layout] if leaf.layout is not None else {}
        grid = None
        if d.get("kind") == "mesh":
            self._layout(leaf)  # validates the description (and is cheap to build)
            mesh = self._meshes[d["mesh"]]
            spec: list[list[str]] = d["spec"]
            used = [mesh.axes.index(a) for axes in spec for a in axes]
            rest = [i for i in range(len(mesh.shape)) if i not in used]
            pieces = [math.prod(mesh.shape[mesh.axes.index(a)] for a in axes) for axes in spec]
            t = mesh.processes.reshape(mesh.shape).transpose(used + rest)
            t = t.reshape([*pieces, -1])
            steps = np.asarray([n // k for n, k in zip(leaf.shape, pieces, strict=True)], np.int64)
            grid = (t, np.maximum(steps, 1))
        self._grids[key] = grid
        return grid

    def candidates(self, leaf: ArrayLeaf, boxes: Sequence[BoundsArrays]) -> np.ndarray:
        """The processes that may have written chunks overlapping `boxes`."""
        if leaf.writers is not None and len(leaf.writers) <= 64:
            return np.asarray(leaf.writers, np.int64)
        grid = self._mesh_grid(leaf)
        if grid is not None:
            t, steps = grid
            blocks = [
                t[tuple(slice(a, b) for a, b in zip((s // steps).tolist(), (-(-e // steps)).tolist(), strict=True))]
                for s, e in boxes
            ]  # fmt: skip
            procs = np.unique(np.concatenate([b.reshape(-1) for b in blocks]))
            if leaf.writers is not None:
                procs = np.intersect1d(procs, np.asarray(leaf.writers, np.int64))
            return procs
        g, index = self._indexed(leaf)
        parts = []
        for start, stop in boxes:
            u = index.overlapping(start, stop)
            if len(u) == g.count:
                parts = [g.cand_process]
                break
            lo, hi = g.cand_ptr[u], g.cand_ptr[u + 1]
            parts.extend(g.cand_process[a:b] for a, b in zip(lo.tolist(), hi.tolist(), strict=True))
        procs = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        if leaf.writers is not None:
            procs = np.intersect1d(procs, np.asarray(leaf.writers, np.int64))
        return procs
