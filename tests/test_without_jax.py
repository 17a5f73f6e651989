"""snapshard.torch, a NumPy restore and the CLI in a process where JAX cannot be imported
(an install with PyTorch alone); the tree's structure is the one JAX would give."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import multiproc


def test_torch_state_round_trips_without_jax(tmp_path):
    env = {"SNAPSHARD_TEST_WITHOUT_JAX": "1", "OMP_NUM_THREADS": "1"}
    (proc,) = multiproc.run("torch_alone.py", 1, 1, str(tmp_path), timeout=120, env=env)
    r = proc.result()
    assert r["jax_imported"] is False
    assert r["exact"] == [True, True, True]
    assert r["numpy_weight"] == r["weight"]
    assert r["metadata_leaves"] == 2
    assert r["cli"] == [0, 0]
    # the state_dict's OrderedDict is the node JAX makes of it, keys in insertion order
    model = r["structure"]["c"][r["structure"]["k"].index("model")]
    assert model["t"] == "node" and model["name"] == "collections.OrderedDict"
    assert model["k"] == ["weight", "bias"]


def test_dict_subclasses_flatten_as_jax_does():
    import collections

    import jax  # noqa: F401  (the JAX path of tree.flatten)

    from snapshard import tree

    value = {
        "o": collections.OrderedDict([("b", 1), ("a", {"z": 2})]),
        "d": collections.defaultdict(int, [("y", 1), ("x", 2)]),
    }
    with_jax = tree.flatten(value, lambda x: isinstance(x, int)).structure
    for node, where in ((value["o"], ("o",)), (value["d"], ("d",))):
        pairs = tree.dict_subclass_children(node, where)
        kids = with_jax["c"][with_jax["k"].index(where[0])]
        assert [k for k, _ in pairs] == kids["k"]
