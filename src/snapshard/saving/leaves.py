"""The leaves of a tree being saved as the manifest describes them: classified through the
wing's adapter, digested (what the commit compares between processes), and described with
one compact layout per distinct layout and mesh."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..checksum import crc32c
from ..errors import (
    CorruptCheckpointError,
)
from ..format import (
    ArrayLeaf,
    ChunkTable,
    Leaf,
    ValueLeaf,
    records,
)
from ..format.layout_table import LayoutTable
from ..format.layouts import Mesh, describe_rows, mesh_layout, same_holders
from ..format.leaves import PerProcessLeaf
from ..format.values import encode_value
from ..frameworks import default_save_adapter
from ..tree import FlatTree, Path
from .save_array import MeshSpec, SaveArray, checked_dtype
from .state import PreparedSave, ReplicatedSource, SaveAdapter


def classify_leaves(
    flat: FlatTree, process_count: int, adapter: SaveAdapter | None = None
) -> list[Leaf | SaveArray]:
    """Every leaf of `flat` as a SaveArray or a manifest leaf (JAX's adapter by default)."""
    classify = (adapter or default_save_adapter()).classify
    return [classify(p, v, process_count) for p, v in zip(flat.paths, flat.leaves, strict=True)]


def _layout_digest(arr: SaveArray) -> int:
    """crc32c of where an array's boxes live: equal on every process for a global array."""
    lay = arr.layout
    if lay.memo.digest is None:
        # (a value held by the saving process alone is alike on every process that holds it)
        held = b"own" if lay.memo.own else lay.process_ids.tobytes()
        lay.memo.digest = crc32c(held, crc32c(lay.starts.tobytes() + lay.stops.tobytes()))
    return lay.memo.digest


def leaf_digests(leaves: list[Leaf | SaveArray], values: bool) -> np.ndarray:
    """Per leaf, crc32c of its description and (with `values`) of its value for host values,
    as this process sees them: processes that disagree are found at commit."""
    out = np.zeros(len(leaves), records.DIGEST)
    described: dict[tuple[Any, ...], tuple[str, str]] = {}  # arrays alike: all but the path
    for i, leaf in enumerate(leaves):
        path = path_json(leaf.path)
        if isinstance(leaf, PerProcessLeaf):  # differs by design
            out[i] = (crc32c(f'["per_process", {path}]'.encode()), 0)
            continue
        if not isinstance(leaf, SaveArray):
            assert isinstance(leaf, ValueLeaf)
            desc = f'["value", {path}]'
            value = (
                crc32c(json.dumps(encode_value(leaf.value, leaf.name)).encode()) if values else 0
            )
        else:
            key = (id(leaf.layout), leaf.kind, leaf.dtype, leaf.key_impl, leaf.devices is None)
            around = described.get(key)
            if around is None:
                # json.dumps([kind, path, dtype, shape, key_impl, host, layout digest])
                rest = json.dumps([leaf.dtype.name, list(leaf.shape), leaf.key_impl,
                                   leaf.devices is None, _layout_digest(leaf)])  # fmt: skip
                around = described[key] = (f"[{json.dumps(leaf.kind)}, ", f", {rest[1:]}")
            desc = around[0] + path + around[1]
            value = 0
            if values and isinstance(
                leaf.source, np.ndarray | np.generic
            ):  # NumPy: the same value is assumed on every process
                value = crc32c(np.ascontiguousarray(leaf.source).reshape(-1).view(np.uint8).data)
            elif values and isinstance(leaf.source, ReplicatedSource):
                value = leaf.source.value_digest()
        out[i] = (crc32c(desc.encode()), value)
    return out


_encode_str = json.encoder.encode_basestring_ascii  # what json.dumps writes a str as


def path_json(path: Path) -> str:
    """json.dumps(list(path)), without the encoder's cost per call (str and int keys)."""
    parts = []
    for k in path:
        if type(k) is str:
            parts.append(_encode_str(k))
        else:
            parts.append(int.__repr__(k) if type(k) is int else json.dumps(k))
    return f"[{', '.join(parts)}]"


def describe_leaves(
    prep: PreparedSave,
) -> tuple[list[Leaf], list[dict[str, Any]], list[dict[str, Any]]]:
    """The manifest's leaves, with one compact description per distinct layout and mesh
    (the meshes and layouts lists)."""
    table = LayoutTable()
    # Arrays laid out alike share their layout object: describe each once.
    per_layout: dict[int, tuple[int, bool]] = {}  # id(layout): (layout id, many candidates)
    plans = iter(prep.plan.arrays)
    out: list[Leaf] = []
    counts: dict[int, int] = {}  # id(plan.nbytes): chunks (arrays alike share the column)
    no_chunks = ChunkTable.empty(0)  # v2 leaves list no chunks: one table for them all
    for leaf in prep.leaves:
        if isinstance(leaf, PerProcessLeaf):
            out.append(PerProcessLeaf(leaf.path, None))  # the values stay in their files
            continue
        if not isinstance(leaf, SaveArray):
            out.append(leaf)
            continue
        plan = next(plans)
        known = per_layout.get(id(leaf.layout))
        if known is None:
            lid = table.layout(_describe(leaf, prep.adapter, table))
            groups = leaf.layout.shards
            known = (lid, bool(groups.count) and int(groups.num_candidates.max()) > 8)
            per_layout[id(leaf.layout)] = known
        lid, many_candidates = known
        writers = None
        if many_candidates:
            w = np.unique(plan.writer)
            if len(w) <= 64:
                writers = tuple(int(x) for x in w)
        count = counts.get(id(plan.nbytes))
        if count is None:
            count = counts[id(plan.nbytes)] = int(np.count_nonzero(plan.nbytes))
        out.append(
            ArrayLeaf(
                leaf.path, leaf.kind, checked_dtype(leaf.dtype, leaf.name), leaf.shape,
                leaf.sharding, leaf.key_impl, chunks=no_chunks, layout=lid, writers=writers,
                chunk_count=count,
            )
        )  # fmt: skip
    return out, table.meshes, table.layouts


def describe_layouts(prep: PreparedSave) -> None:
    """Every array's layout description made now (each is kept in its layout's memo), so
    that a process without the framework can describe the leaves (writer_process.py)."""
    for leaf in prep.leaves:
        if not isinstance(leaf, SaveArray):
            continue
        memo = leaf.layout.memo
        if not memo.own and memo.description is None:
            memo.description = _description(leaf, prep.adapter.mesh_of(leaf))


def _describe(
    arr: SaveArray,
    adapter: SaveAdapter,
    table: LayoutTable,
) -> dict[str, Any]:
    """The compact description of an array's layout (format.layouts), checked against the
    layout itself: a description that would mislead a reader falls back to explicit rows."""
    memo = arr.layout.memo
    if memo.own:  # the saving process's own: the union names it (tree_union.py)
        return {"kind": "own"}
    if memo.description is None:
        memo.description = _description(arr, adapter.mesh_of(arr))
    desc, mesh = memo.description
    if mesh is not None:
        desc = {**desc, "mesh": table.mesh(mesh.key, mesh.to_json)}
    return desc


def _description(arr: SaveArray, found: MeshSpec | None) -> tuple[dict[str, Any], Mesh | None]:
    """`found`: the array's mesh and spec, from its framework's adapter."""
    if arr.devices is None and isinstance(arr.source, np.ndarray | np.generic):
        return {"kind": "host"}, None
    if found is not None:
        axes, shape, processes, spec = found
        mesh = Mesh(axes, shape, processes)
        try:
            derived = mesh_layout(mesh, spec, arr.shape, arr.layout.itemsize, arr.name)
        except CorruptCheckpointError:
            derived = None
        if derived is not None and same_holders(derived.shards, arr.layout.shards):
            return {"kind": "mesh", "spec": spec}, mesh
    return describe_rows(arr.layout), None
