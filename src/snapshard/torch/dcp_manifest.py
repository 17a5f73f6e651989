"""A DCP save in snapshard's format: the checkpoint's leaves and tree, numbered from DCP's
global plan, and its manifest, built from them and the ranks' reports (the coordinator's
two steps of torch/dcp_storage.py's protocol).

Non-tensor state (DCP's `BYTE_IO` items, which DCP pickles): a Python `int`, `float`,
`bool`, `str` or `None` is stored as a value in the manifest, no pickle involved (taken
from the default planner's `lookup_object` by the rank that writes it, dcp_rank_writer.py); anything else is stored as the bytes DCP's
planner made of it (`torch.save`), an opaque `uint8` array leaf listed in the manifest's
`extra["dcp"]["pickled"]`. snapshard's own loaders never unpickle it; `dcp.load` through
snapshard.torch.StorageReader hands it to DCP's planner, which unpickles it as DCP does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ..errors import SnapshardError
from ..format import ArrayLeaf, Leaf, Manifest, ProcessTable, ValueLeaf, records
from ..format.layout_table import LayoutTable
from ..format.layouts import describe_rows
from ..format.values import decode_value
from ..planning.layout import ArrayLayout
from ..tree import JsonNode, Path, flatten, path_str
from .dtypes import numpy_dtype

PICKLED_KEY = "dcp"  # manifest extra: {"pickled": [leaf names stored as DCP's pickles]}


class DcpStorageError(SnapshardError):
    """DCP handed snapshard's storage writer or reader something it cannot store or read."""


@dataclass(frozen=True)
class DcpLeaf:
    """One leaf of a DCP save: its state dict name (fqn), path, and what is written."""

    fqn: str
    path: Path
    is_tensor: bool
    dtype: np.dtype  # uint8 for DCP's pickled bytes
    shape: tuple[int, ...]  # () for bytes: their length is known when they are written
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]]  # offsets, sizes, writer rank


@dataclass
class RankReport:
    """What one rank wrote, gathered to the coordinator by DCP with its write results."""

    attempt: str
    rank: int
    nonce: str
    data_sizes: list[int]
    record_size: int
    record_crc: int
    values: dict[int, dict[str, Any]] = field(default_factory=dict)  # leaf -> encoded value
    pickled: dict[int, int] = field(default_factory=dict)  # leaf -> bytes written
    codecs: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Slot:
    """A leaf's place in the tree rebuilt from DCP's paths (flattened into the numbering)."""

    fqn: str


def _nested(paths: list[tuple[str, Path]], where: str) -> Any:
    """The state dict's shape rebuilt from the leaves' paths: dicts, and lists where the
    keys of a level are 0..n-1 (as DCP's unflattening makes them)."""

    def listed(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        kids = {k: listed(v) for k, v in node.items()}
        if kids and all(type(k) is int for k in kids) and sorted(kids) == list(range(len(kids))):
            return [kids[i] for i in range(len(kids))]
        return kids

    root: dict[Any, Any] = {}
    for fqn, path in paths:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise DcpStorageError(f"save to {where}: leaf {fqn!r} lies inside another leaf")
        if not path or path[-1] in node:
            raise DcpStorageError(f"save to {where}: leaf {fqn!r} has the path of another leaf")
        node[path[-1]] = _Slot(fqn)
    return listed(root)


def _path_of(fqn: str, mappings: Any) -> Path:
    """The state dict path DCP's planner recorded for `fqn` (its flattening), else the fqn
    itself as one key (a flat state dict)."""
    path = mappings.get(fqn) if isinstance(mappings, dict) else None
    if isinstance(path, tuple | list) and path:
        return tuple(k if isinstance(k, int) else str(k) for k in path)
    return (fqn,)


def _leaves_of(plans: list[SavePlan], where: str) -> dict[str, DcpLeaf]:
    """Every item of the global plan, as leaves: each tensor's chunks with their writers."""
    mappings: dict[str, Any] = {}
    for plan in plans:
        if isinstance(plan.planner_data, dict):
            mappings.update(plan.planner_data)
    found: dict[str, DcpLeaf] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            fqn = item.index.fqn
            leaf = found.get(fqn)
            if leaf is None:
                leaf = found[fqn] = _new_leaf(item, _path_of(fqn, mappings), where)
            if item.tensor_data is not None:
                chunk = item.tensor_data.chunk
                leaf.chunks.append((tuple(chunk.offsets), tuple(chunk.sizes), rank))
            elif leaf.chunks:
                raise DcpStorageError(f"save to {where}: leaf {fqn!r} is written by two ranks")
            else:
                leaf.chunks.append(((0,), (0,), rank))
    return found


def _new_leaf(item: WriteItem, path: Path, where: str) -> DcpLeaf:
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        return DcpLeaf(fqn, path, False, np.dtype(np.uint8), (), [])
    if item.tensor_data is None:
        raise DcpStorageError(f"save to {where}: leaf {fqn!r}: a tensor item without its shape")
    dtype = numpy_dtype(item.tensor_data.properties.dtype, leaf=fqn)
    return DcpLeaf(fqn, path, True, dtype, tuple(item.tensor_data.size), [])


def numbered_leaves(plans: list[SavePlan], where: str) -> tuple[dict[str, DcpLeaf], JsonNode]:
    """Every item of the global plan as a leaf, in the order of the checkpoint's tree
    rebuilt from DCP's paths (the leaf numbering), and the tree's structure."""
    leaves = _leaves_of(plans, where)
    tree = _nested([(leaf.fqn, leaf.path) for leaf in leaves.values()], where)
    flat = flatten(tree, lambda x: isinstance(x, _Slot))
    return {slot.fqn: leaves[slot.fqn] for slot in flat.leaves}, flat.structure


def manifest_of(
    structure: dict[str, Any], leaves: list[DcpLeaf], reports: list[RankReport]
) -> tuple[Manifest, ProcessTable]:
    """The checkpoint's manifest: per tensor one explicit layout (DCP's chunks, each held by
    the rank that wrote it); plain values inline; DCP's pickled bytes as uint8 arrays."""
    values = {i: v for r in reports for i, v in r.values.items()}
    pickled = {i: (n, r.rank) for r in reports for i, n in r.pickled.items()}
    table = LayoutTable()
    out: list[Leaf] = []
    for i, leaf in enumerate(leaves):
        if i in values:
            out.append(ValueLeaf(leaf.path, decode_value(values[i], leaf.fqn)))
            continue
        if leaf.is_tensor:
            shape, chunks, kind = leaf.shape, leaf.chunks, "dcp"
        elif i in pickled:
            shape, chunks = (pickled[i][0],), [((0,), (pickled[i][0],), pickled[i][1])]
            kind = "dcp pickle"  # what `snapshard info` shows for it
        else:
            raise DcpStorageError(f"leaf {leaf.fqn!r}: no rank reported writing it")
        lid = table.layout(describe_rows(_layout(shape, leaf.dtype.itemsize, chunks)))
        count = sum(1 for _, sizes, _ in chunks if math.prod(sizes) > 0)
        out.append(
            ArrayLeaf(
                leaf.path, "array", leaf.dtype.name, shape, {"type": kind, "chunks": len(chunks)},
                layout=lid, chunk_count=count,
            )
        )  # fmt: skip
    processes = ProcessTable(
        nonces=[r.nonce for r in reports],
        data_sizes=[r.data_sizes for r in reports],
        record_sizes=[r.record_size for r in reports],
        record_crcs=[r.record_crc for r in reports],
    )
    names = [path_str(leaves[i].path) for i in sorted(pickled)]
    manifest = Manifest.of_processes(
        processes, structure, out, write_mode="single_replica", layouts=table.layouts,
        extra={PICKLED_KEY: {"pickled": names}} if names else {},
        codecs=[records.CODECS[c] for c in sorted({c for r in reports for c in r.codecs})],
    )  # fmt: skip
    return manifest, processes


def _layout(
    shape: tuple[int, ...],
    itemsize: int,
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]],
) -> ArrayLayout:
    """DCP's chunks of one array as a layout: each box held by the rank that wrote it."""
    nd = len(shape)
    starts = np.asarray([c[0] for c in chunks], np.int64).reshape(len(chunks), nd)
    stops = starts + np.asarray([c[1] for c in chunks], np.int64).reshape(len(chunks), nd)
    ranks = np.asarray([c[2] for c in chunks], np.int64)
    return ArrayLayout(shape, itemsize, starts, stops, np.zeros(len(chunks), np.int64), ranks)
