"""The union of the processes' trees of a save of differing trees (SaveOptions.trees_differ), as process 0
makes it at the commit.

Each process of a save of differing trees writes, beside its record file, its own tree: its structure
and its leaves as the manifest would describe them (layouts, writers, chunk counts), with
the digest of each array's write plan. Processes whose reports carry the same digest saved
the same tree with the same values, so process 0 reads one tree file (and the digests of one
record file) per distinct digest: a pipeline-parallel job of 10,000 processes with 8 stages
reads 8 of each. Then, pure:

1. the structures are merged: a key that some trees have and others lack is added, a
   container that two trees give different kinds or lengths of is refused;
2. the leaves are numbered in the merged structure's order (the manifest's leaves), and
   each tree's leaves are mapped onto them (format.leaf_map);
3. a leaf several trees hold must agree: the same kind, dtype and shape (refused naming the
   leaf and one process of each side), the same value where it is a value or a plain
   array (each holder wrote a copy), and where two trees hold one copy (the same layout:
   a DTensor on a mesh spanning both), the same write plan. Two copies of which one is
   sharded over a mesh of its own tree are refused: no process holds such a copy whole, so
   nothing says the copies are equal. The first tree's copy is the one the manifest
   describes; the chunks of other copies stay unread.

No I/O here: saving/agreement.py reads the files, saving/commit.py writes the manifest.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CoordinationError
from ..format import ArrayLeaf, Leaf, ValueLeaf
from ..format.layout_table import LayoutTable
from ..format.layouts import describe_rows
from ..format.leaf_map import LeafMap
from ..format.leaves import PerProcessLeaf
from ..planning.layout import own_layout
from ..tree import JsonNode, Path, path_str


@dataclass
class SavedTree:
    """One distinct tree of a save of differing trees, as the first of its processes wrote it."""

    processes: list[int]  # the processes that saved it, ascending
    structure: JsonNode
    leaves: list[Leaf]
    layouts: list[dict[str, Any]]
    meshes: list[dict[str, Any]]
    plans: list[int]  # per leaf, the digest of its write plan (0: not an array)
    digests: np.ndarray  # per leaf, format.records.DIGEST as its first process saw it

    @property
    def first(self) -> int:
        return self.processes[0]


@dataclass
class Union:
    """The manifest's part of a save of differing trees: the merged tree, its leaves (with layouts
    and meshes renumbered), and which leaves each process saved."""

    structure: JsonNode
    leaves: list[Leaf]
    layouts: list[dict[str, Any]]
    meshes: list[dict[str, Any]]
    leaf_map: LeafMap


def union(trees: list[SavedTree], process_count: int, what: str) -> Union:
    """The union of `trees` (in the order of their first process); CoordinationError where
    they do not fit together, naming the leaf and a process of each side."""
    trees = sorted(trees, key=lambda t: t.first)
    structure = trees[0].structure
    for t in trees[1:]:
        structure = _merge(structure, t.structure, (), (trees[0].first, t.first), what)
    paths: list[Path] = []
    structure = _numbered(structure, (), paths)
    index = {p: g for g, p in enumerate(paths)}
    maps = [np.asarray([index[leaf.path] for leaf in t.leaves], np.int64) for t in trees]
    chosen: list[tuple[int, int] | None] = [None] * len(paths)  # (tree, its leaf)
    for k, (t, m) in enumerate(zip(trees, maps, strict=True)):
        for i, g in enumerate(m.tolist()):
            first = chosen[g]
            if first is None:
                chosen[g] = (k, i)
            else:
                _check_alike(trees[first[0]], first[1], t, i, what)
    out = _Renumbered()
    leaves = []
    for pick in chosen:
        assert pick is not None  # every path of the merged structure is some tree's leaf
        leaves.append(out.leaf(trees[pick[0]], pick[1]))
    tree_of = np.zeros(process_count, np.int64)
    for k, t in enumerate(trees):
        tree_of[t.processes] = k
    return Union(structure, leaves, out.layouts, out.meshes, LeafMap(maps, tree_of))


# Mappings whose keys a save of differing trees merges (a module's state_dict() is an OrderedDict).
_DICTS = ("collections.OrderedDict", "collections.defaultdict")


def _merge(a: JsonNode, b: JsonNode, path: Path, who: tuple[int, int], what: str) -> JsonNode:
    """Structure `a` (of process who[0]) with what `b` (of process who[1]) adds."""
    kind_a, kind_b = a.get("t"), b.get("t")
    if kind_a != kind_b:
        raise CoordinationError(
            f"{what}: {path_str(path) or 'the tree'!r} is a {kind_a} on process {who[0]} "
            f"and a {kind_b} on process {who[1]}"
        )
    if kind_a == "leaf":
        return a
    mapping = kind_a == "node" and a.get("name") == b.get("name") and a.get("name") in _DICTS
    if kind_a == "dict" or mapping:
        kids = dict(zip(a["k"], a["c"], strict=True))
        for k, child in zip(b["k"], b["c"], strict=True):
            kids[k] = _merge(kids[k], child, (*path, k), who, what) if k in kids else child
        return {**a, "k": list(kids), "c": list(kids.values())}
    keys_a, keys_b = a.get("k"), b.get("k")
    if len(a["c"]) != len(b["c"]) or keys_a != keys_b or a.get("name") != b.get("name"):
        shown = path_str(path) or "the tree"
        raise CoordinationError(
            f"{what}: {shown!r} is a {a.get('name', kind_a)} of {len(a['c'])} on process "
            f"{who[0]} and a {b.get('name', kind_a)} of {len(b['c'])}"
            f"{'' if keys_a == keys_b else ' with other keys'} on process {who[1]}: a "
            "save of differing trees merges dicts only (give each rank's entries their own keys)"
        )
    keys = keys_a if keys_a is not None else list(range(len(a["c"])))
    kids_out = [
        _merge(x, y, (*path, k), who, what) for k, x, y in zip(keys, a["c"], b["c"], strict=True)
    ]
    return {**a, "c": kids_out}


def _numbered(node: JsonNode, path: Path, paths: list[Path]) -> JsonNode:
    """`node` with its leaves numbered in order; their paths appended to `paths`."""
    if node["t"] == "leaf":
        paths.append(path)
        return {"t": "leaf", "i": len(paths) - 1}
    keys = node.get("k", list(range(len(node["c"]))))
    kids = [_numbered(c, (*path, k), paths) for k, c in zip(keys, node["c"], strict=True)]
    return {**node, "c": kids}


def _describe(leaf: Leaf) -> str:
    if isinstance(leaf, ArrayLeaf):
        return f"{leaf.dtype}{list(leaf.shape)}"
    return "a per-process value" if isinstance(leaf, PerProcessLeaf) else "a value"


def _check_alike(a: SavedTree, i: int, b: SavedTree, j: int, what: str) -> None:
    """Leaf i of tree `a` and leaf j of tree `b` (one path) fit together."""
    la, lb = a.leaves[i], b.leaves[j]
    name = la.name
    if type(la) is not type(lb) or (
        isinstance(la, ArrayLeaf)
        and isinstance(lb, ArrayLeaf)
        and (la.kind, la.dtype, la.shape) != (lb.kind, lb.dtype, lb.shape)
    ):
        raise CoordinationError(
            f"{what}: leaf {name!r} is {_describe(la)} on process {a.first} and "
            f"{_describe(lb)} on process {b.first}"
        )
    if isinstance(la, PerProcessLeaf):
        return
    va, vb = int(a.digests["value"][i]), int(b.digests["value"][j])
    if va and vb and va != vb:
        raise CoordinationError(
            f"{what}: leaf {name!r} has another value on process {b.first} than on process "
            f"{a.first}; in a save of differing trees a key given by several ranks is one value: give "
            "values that differ by rank their own keys, or wrap them in snapshard.PerProcess"
        )
    if isinstance(la, ArrayLeaf) and isinstance(lb, ArrayLeaf):
        doc_a, doc_b = _layout_doc(a, la), _layout_doc(b, lb)
        own = _OWN in doc_a, _OWN in doc_b  # a value each process holds whole: its own copy
        if doc_a == doc_b and not any(own):  # one copy, on a mesh spanning both trees
            if a.plans[i] != b.plans[j]:
                raise CoordinationError(
                    f"{what}: leaf {name!r} was planned differently on process {a.first} and "
                    f"on process {b.first}: the ranks of its mesh passed different sets of "
                    "tensors of that mesh (every rank of a DTensor's mesh must pass every "
                    "DTensor of it)"
                )
        elif not all(own):
            # Two copies, one of them sharded over its own mesh (a stage's sub-mesh): no
            # process holds its whole value, so no digest says the copies are equal, and
            # keeping the first would silently drop the other's values where they differ.
            raise CoordinationError(
                f"{what}: leaf {name!r} is saved as two copies, on process {a.first} "
                f"({_copy(own[0])}) and on process {b.first} ({_copy(own[1])}), whose values "
                "cannot be compared: give each copy its own key (e.g. "
                "optimizer.state_dict() numbers parameters from 0 on every stage; "
                "get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True)) "
                "keys them by name), or place one DTensor on a mesh spanning both"
            )
    assert isinstance(la, ArrayLeaf | ValueLeaf)


_OWN = '"kind": "own"'


def _copy(own: bool) -> str:
    return "a plain tensor or array" if own else "sharded over that process's mesh"


def _layout_doc(tree: SavedTree, leaf: ArrayLeaf) -> str:
    """The leaf's layout with its mesh spelt out, as text: equal for one copy."""
    doc = dict(tree.layouts[leaf.layout]) if leaf.layout is not None else {}
    if "mesh" in doc:
        doc["mesh"] = tree.meshes[doc["mesh"]]
    return json.dumps(doc, sort_keys=True)


class _Renumbered(LayoutTable):
    """The union's layouts and meshes, each distinct one listed once."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[tuple[Any, ...], int] = {}  # (tree, its layout, shape): the union's

    def leaf(self, tree: SavedTree, i: int) -> Leaf:
        leaf = tree.leaves[i]
        if not isinstance(leaf, ArrayLeaf) or leaf.layout is None:
            return leaf
        key = (id(tree), leaf.layout, leaf.shape)  # (one "own" layout serves every shape)
        if key not in self._seen:
            self._seen[key] = self._layout_id(tree, leaf)
        return dataclasses.replace(leaf, layout=self._seen[key])

    def _layout_id(self, tree: SavedTree, leaf: ArrayLeaf) -> int:
        assert leaf.layout is not None
        doc = dict(tree.layouts[leaf.layout])
        if doc.get("kind") == "own":  # held by the process that saved it: the tree's first
            doc = describe_rows(own_layout(leaf.shape, 1, tree.first))
        if "mesh" in doc:
            mesh = tree.meshes[doc["mesh"]]
            doc["mesh"] = self.mesh(json.dumps(mesh, sort_keys=True), lambda: mesh)
        return self.layout(doc)
