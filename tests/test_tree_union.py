"""The union of differing trees at the commit (saving/tree_union.py) and the leaf map it leaves in
the manifest (format/leaf_map.py): pure, no processes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from snapshard.errors import CoordinationError, CorruptCheckpointError
from snapshard.format import ArrayLeaf, ChunkTable, ValueLeaf, records
from snapshard.format.leaf_map import LeafMap
from snapshard.saving.tree_union import SavedTree, union
from snapshard.tree import flatten


def _tree(processes, entries, values=None, plans=None):
    """A SavedTree of `entries` {name: (dtype, shape) | python value}, each array laid out
    as one row held by its first process."""
    structure = flatten({k: 0 for k in entries}, lambda x: not isinstance(x, dict)).structure
    leaves, layouts = [], []
    for name, spec in entries.items():
        if isinstance(spec, tuple):
            layouts.append(
                {"kind": "rows", "rows": [[processes[0], [0] * len(spec[1]), list(spec[1])]]}
            )
            leaves.append(ArrayLeaf((name,), "array", spec[0], spec[1], {}, None,
                                    chunks=ChunkTable.empty(0), layout=len(layouts) - 1))  # fmt: skip
        else:
            leaves.append(ValueLeaf((name,), spec))
    digests = np.zeros(len(leaves), records.DIGEST)
    digests["value"] = values or [0] * len(leaves)
    return SavedTree(
        list(processes), structure, leaves, layouts, [], plans or [0] * len(leaves), digests
    )


def test_stages_merge_into_one_tree_and_each_process_maps_onto_it():
    a = _tree([0, 2], {"layers.0.w": ("float32", (4, 4)), "step": 3})
    b = _tree([1, 3], {"layers.1.w": ("float32", (4, 4)), "step": 3})
    u = union([b, a], 4, "save")
    assert [leaf.path for leaf in u.leaves] == [("layers.0.w",), ("step",), ("layers.1.w",)]
    assert u.leaf_map.tree_of.tolist() == [0, 1, 0, 1]
    assert [t.tolist() for t in u.leaf_map.trees] == [[0, 1], [2, 1]]
    # each process's own numbers of the manifest's leaves (-1: it saved none)
    assert u.leaf_map.local(1, np.arange(3), 3).tolist() == [-1, 1, 0]
    assert len(u.layouts) == 2 and u.leaves[2].layout == 1


def test_a_key_with_two_shapes_names_the_leaf_and_both_processes():
    a = _tree([0], {"shared": ("float32", (2,))})
    b = _tree([1], {"shared": ("float32", (3,))})
    with pytest.raises(
        CoordinationError,
        match=r"leaf 'shared' is float32\[2\] on process 0 and float32\[3\] on process 1",
    ):
        union([a, b], 2, "save")


def test_copies_of_a_value_must_be_equal():
    a = _tree([0], {"lr": 0.1}, values=[11])
    b = _tree([1], {"lr": 0.2}, values=[12])
    with pytest.raises(CoordinationError, match="leaf 'lr' has another value on process 1"):
        union([a, b], 2, "save")


def test_one_copy_planned_two_ways_is_refused():
    a = _tree([0], {"w": ("float32", (8,))}, plans=[5])
    b = _tree([1], {"w": ("float32", (8,))}, plans=[6])
    b.layouts = a.layouts  # one copy: the same holders
    with pytest.raises(CoordinationError, match="planned differently"):
        union([a, b], 2, "save")


def test_a_list_of_another_length_is_refused():
    a = SavedTree(
        [0],
        flatten({"x": [1, 2]}, lambda x: isinstance(x, int)).structure,
        [ValueLeaf(("x", 0), 1), ValueLeaf(("x", 1), 2)],
        [],
        [],
        [0, 0],
        np.zeros(2, records.DIGEST),
    )
    b = SavedTree(
        [1],
        flatten({"x": [1]}, lambda x: isinstance(x, int)).structure,
        [ValueLeaf(("x", 0), 1)],
        [],
        [],
        [0],
        np.zeros(1, records.DIGEST),
    )
    with pytest.raises(CoordinationError, match="merges dicts only"):
        union([a, b], 2, "save")


@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=30, unique=True),
    st.lists(st.integers(0, 1), min_size=2, max_size=40),
)
def test_the_leaf_map_round_trips_through_json(tree, tree_of):
    m = LeafMap(
        [np.asarray(tree, np.int64), np.asarray(sorted(tree), np.int64)], np.asarray(tree_of)
    )
    back = LeafMap.from_json(m.to_json(), len(tree_of), 51, "m")
    assert [t.tolist() for t in back.trees] == [t.tolist() for t in m.trees]
    assert back.tree_of.tolist() == tree_of


@pytest.mark.parametrize(
    "doc",
    [
        {"trees": [[[0, 2]]], "tree_of": [[1, 2]]},  # no tree 1
        {"trees": [[[0, 3]]], "tree_of": [[0, 2]]},  # leaf 2 of 2
        {"trees": [[[0, 1], [0, 1]]], "tree_of": [[0, 2]]},  # one leaf twice
        {"trees": [[[0, 1]]], "tree_of": [[0, 3]]},  # 3 processes of 2
        {"trees": "x", "tree_of": [[0, 2]]},
    ],
)
def test_a_malformed_leaf_map_is_refused(doc):
    with pytest.raises(CorruptCheckpointError):
        LeafMap.from_json(doc, 2, 2, "m")


def test_values_of_each_process_own_are_laid_out_on_the_first_process_of_their_tree():
    """A plain tensor held by the process that saved it ("own"): one layout entry of the
    tree serves every shape, and the union gives each leaf rows of its own shape."""
    a = _tree([2, 3], {"x": ("float32", (4,)), "y": ("int8", (2, 5))})
    a.layouts = [{"kind": "own"}]
    a.leaves = [dataclasses.replace(leaf, layout=0) for leaf in a.leaves]
    u = union([a], 4, "save")
    x, y = (_layout(u, leaf) for leaf in u.leaves)
    assert x.shape == (4,) and y.shape == (2, 5)
    assert x.process_ids.tolist() == y.process_ids.tolist() == [2]


def _layout(u, leaf):
    from snapshard.format.layouts import rows_layout

    d = u.layouts[leaf.layout]
    return rows_layout(d["rows"], leaf.shape, 1, d["devices"], "m")
