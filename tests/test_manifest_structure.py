"""The tree checks every read makes (format.validate.validate_structure): each leaf of the
list referenced once by the tree, at the path its entry states, keys of str and int only."""

from __future__ import annotations

import pytest

from snapshard.errors import CorruptCheckpointError
from snapshard.format import Manifest, validate_structure
from snapshard.format.leaves import ValueLeaf


def manifest(structure: dict, paths: list[tuple]) -> Manifest:
    return Manifest(structure, [ValueLeaf(p, i) for i, p in enumerate(paths)], [])


def node(t: str, kids: list, keys: list | None = None) -> dict:
    return {"t": t, "c": kids, **({"k": keys} if keys is not None else {})}


def leaf(i: object) -> dict:
    return {"t": "leaf", "i": i}


def test_a_valid_tree_of_dicts_lists_and_tuples_passes():
    tree = node("dict", [node("list", [leaf(0), node("tuple", [leaf(1)])]), leaf(2)], ["a", 7])
    validate_structure(manifest(tree, [("a", 0), ("a", 1, 0), (7,)]), "m")


@pytest.mark.parametrize(
    "tree, paths, problem",
    [
        # two leaves swapped: each at the other's path
        (
            node("dict", [leaf(1), leaf(0)], ["a", "b"]),
            [("a",), ("b",)],
            "leaf 1 has path 'b', the tree holds it at 'a'",
        ),
        # a key "1" in the tree, 1 in the leaf's entry (equal as text, not as keys)
        (node("dict", [leaf(0)], ["1"]), [(1,)], "tree holds it at '1'"),
        # a list position where the entry says a key
        (node("list", [leaf(0)]), [("0",)], "tree holds it at '0'"),
        # one leaf referenced twice, another never
        (node("dict", [leaf(0), leaf(0)], ["a", "b"]), [("a",), ("b",)], "disagree"),
        # a reference beyond the list
        (node("dict", [leaf(0), leaf(2)], ["a", "b"]), [("a",), ("b",)], "disagree"),
        # a leaf of the list the tree never references
        (node("dict", [leaf(0)], ["a"]), [("a",), ("b",)], "disagree"),
        (node("dict", [leaf(True)], ["a"]), [("a",)], "malformed leaf reference"),
        (node("dict", [leaf(0)], [True]), [(1,)], "malformed key"),
        (node("dict", [leaf(0), leaf(1)], ["a", "a"]), [("a",), ("a",)], "duplicate key"),
        (node("dict", [leaf(0)], ["a", "b"]), [("a",)], "keys and children disagree"),
        (node("set", [leaf(0)]), [(0,)], "malformed tree node of type 'set'"),
        (node("list", [[]]), [], "malformed tree node"),
    ],
)
def test_a_tree_that_does_not_place_every_leaf_once_at_its_path_is_refused(tree, paths, problem):
    with pytest.raises(CorruptCheckpointError, match=problem.replace("(", r"\(")):
        validate_structure(manifest(tree, paths), "m")


def test_depth_is_bounded_without_recursion():
    deep: dict = leaf(0)
    for _ in range(300):
        deep = node("list", [deep])
    with pytest.raises(CorruptCheckpointError, match="nested more than 256 deep"):
        validate_structure(manifest(deep, [(0,) * 300]), "m")
    ok: dict = leaf(0)
    for _ in range(256):
        ok = node("list", [ok])
    validate_structure(manifest(ok, [(0,) * 256]), "m")


def test_a_summary_has_the_manifests_own_fields_and_is_checked_by_its_checksum(tmp_path):
    import time

    import numpy as np

    import snapshard
    from snapshard.format import MANIFEST_NAME
    from snapshard.format.reading import read_summary
    from snapshard.storage import storage_for

    where = tmp_path / "c"
    before = time.time()
    snapshard.save(where, {"a": np.arange(4, dtype=np.float32), "b": np.ones(3), "n": 3})
    with storage_for(where) as st:
        s = read_summary(st)
    assert (s.version, s.total_bytes, s.leaf_count) == (2, 16 + 24, 3)
    assert before - 1 <= s.created_unix <= time.time() + 1
    raw = (where / MANIFEST_NAME).read_bytes()
    (where / MANIFEST_NAME).write_bytes(raw.replace(b'"float32"', b'"float64"', 1))
    with storage_for(where) as st, pytest.raises(CorruptCheckpointError, match="checksum"):
        read_summary(st)


def test_equal_sharding_descriptions_share_one_object(tmp_path):
    import numpy as np

    import snapshard
    from snapshard.format.reading import read_manifest
    from snapshard.storage import storage_for

    snapshard.save(tmp_path / "c", {f"x{i}": np.zeros(4, np.float32) for i in range(5)})
    with storage_for(tmp_path / "c") as st:
        leaves = read_manifest(st).arrays
    assert leaves[0].sharding == {"type": "host"}
    assert all(leaf.sharding is leaves[0].sharding for leaf in leaves)
