"""Pure pieces of the interop layer: slabs, zarr chunk grids, Orbax tree metadata."""

from __future__ import annotations

import math

import numpy as np
import pytest

from snapshard.cli.reader import slabs
from snapshard.errors import CorruptCheckpointError
from snapshard.format.validate import coverage_problems
from snapshard.orbax.meta import describe_sharding, parse_tree_metadata


@pytest.mark.parametrize(
    ("start", "stop", "max_bytes"),
    [
        ((0, 0, 0), (4, 5, 6), 4 * 5 * 6 * 4),  # fits whole
        ((0, 0, 0), (4, 5, 6), 40),  # cuts the last axis into runs of 10 elements
        ((2, 1, 3), (6, 6, 9), 4 * 6 * 2),  # a run of rows of the middle axis
        ((1, 0), (8, 7), 4 * 7 * 3),  # three whole rows at a time
        ((0,), (10,), 1),  # below one element: one element each
        ((), (), 1),
    ],
)
def test_slabs_tile_the_box_in_c_order_within_the_budget(start, stop, max_bytes):
    shape = tuple(e - s for s, e in zip(start, stop, strict=True))
    flat = np.arange(math.prod(shape)).reshape(shape)
    seen = []
    for s, e in slabs(start, stop, 4, max_bytes):
        box = tuple(slice(a - o, b - o) for a, b, o in zip(s, e, start, strict=True))
        piece = flat[box].reshape(-1)
        assert piece.size * 4 <= max(max_bytes, 4)
        assert np.array_equal(piece, np.arange(piece[0], piece[0] + piece.size))  # contiguous
        seen.append(piece)
    assert np.array_equal(np.concatenate(seen), flat.reshape(-1))  # in order, exactly once


def test_slabs_of_an_empty_box_and_exact_cuts():
    assert list(slabs((0, 0), (0, 5), 4, 100)) == []
    assert list(slabs((0,), (3,), 4, 8)) == [((0,), (2,)), ((2,), (3,))]


def test_chunk_grid_tiles_the_array():
    from snapshard.orbax.reader import chunk_grid

    for shape, chunk in [((7, 13), (2, 5)), ((16,), (4,)), ((), ()), ((5, 3), None)]:
        t = chunk_grid(shape, chunk, 2)
        assert coverage_problems(shape, t.starts, t.stops) == ([], [])
        assert int(t.nbytes.sum()) == math.prod(shape) * 2
    assert len(chunk_grid((7, 13), (2, 5), 2)) == 4 * 3


def _entry(keys, value_type="jax.Array"):
    return {
        "key_metadata": [{"key": str(k), "key_type": 1 if isinstance(k, int) else 2} for k in keys],
        "value_metadata": {"value_type": value_type},
    }


def test_tree_metadata_becomes_a_structure_and_leaves():
    doc = {
        "tree_metadata": {
            str(i): _entry(keys, vt)
            for i, (keys, vt) in enumerate(
                [
                    (("a", 1), "np.ndarray"),
                    (("a", 0), "scalar"),
                    (("b", "c"), "jax.Array"),
                    (("d",), "Dict"),
                    (("e",), "None"),
                ]
            )
        }
    }
    structure, entries = parse_tree_metadata(doc, "x")
    assert [e.path for e in entries] == [("a", 0), ("a", 1), ("b", "c"), ("e",)]
    assert [e.param for e in entries] == ["a.0", "a.1", "b.c", "e"]
    assert structure["t"] == "dict" and structure["k"] == ["a", "b", "d", "e"]
    assert structure["c"][0]["t"] == "list" and structure["c"][2] == {"t": "dict", "k": [], "c": []}


@pytest.mark.parametrize(
    "entries",
    [
        [("a", 0), ("a", 2)],  # a list with a gap
        [("a", 0), ("a", "x")],  # both a sequence and a dict
        [("a",), ("a", "b")],  # both a leaf and a subtree
        [("a", "b"), ("a",)],
    ],
)
def test_inconsistent_tree_metadata_is_refused(entries):
    doc = {"tree_metadata": {str(i): _entry(k) for i, k in enumerate(entries)}}
    with pytest.raises(CorruptCheckpointError, match="x"):
        parse_tree_metadata(doc, "x")
    with pytest.raises(CorruptCheckpointError, match="tree_metadata"):
        parse_tree_metadata({"something": 1}, "x")


def test_orbax_sharding_description():
    named = (
        '{"sharding_type": "NamedSharding", "shape": [2, 4], "axis_names": ["data", "model"],'
        ' "partition_spec": [null, "model"]}'
    )
    assert describe_sharding(named) == {
        "type": "NamedSharding",
        "mesh": {"data": 2, "model": 4},
        "spec": [None, "model"],
        "num_devices": 8,
    }
    single = '{"sharding_type": "SingleDeviceSharding", "device_str": "cpu:0"}'
    assert describe_sharding(single) == {"type": "SingleDeviceSharding", "num_devices": 1}
    assert describe_sharding("not json") is None
