"""snapshard.torch, NumPy state and the CLI in a process where JAX cannot be imported (an
install with PyTorch or NumPy alone); the tree's structure is the one JAX would give."""

from __future__ import annotations

import sys

import pytest

import multiproc


def test_torch_state_round_trips_without_jax(tmp_path):
    pytest.importorskip("torch")
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


def test_numpy_state_round_trips_without_jax(tmp_path):
    env = {"SNAPSHARD_TEST_WITHOUT_JAX": "1", "OMP_NUM_THREADS": "1"}
    (proc,) = multiproc.run("numpy_alone.py", 1, 1, str(tmp_path), timeout=120, env=env)
    r = proc.result()
    assert r["jax_imported"] is False
    assert r["types"] == ["Moments", "OrderedDict"]  # the target's classes come back
    assert r["w"] == [[float(4 * i + j) for j in range(4)] for i in range(3)]
    assert r["nu"] == [2.0] * 4
    assert r["layers_keys"] == ["b", "a"] and r["layers_a"] is None
    assert r["step"] == 7 and r["cursor"] == 11
    assert r["untargeted_keys"] == ["cursor", "layers", "nothing", "opt", "step", "w"]
    assert r["untargeted_layers_b"] == [0, 1, 2]
    assert r["managed_equal"] is True
    assert r["metadata_shape"] == [3, 4]


def test_targets_rebuild_the_same_with_and_without_jax():
    """flatten_target's JAX-free path gives the paths and the rebuilt tree that JAX gives."""
    import collections
    from typing import NamedTuple

    import jax
    import numpy as np

    from snapshard import tree
    from snapshard.reading.restore import is_target_leaf

    class Pair(NamedTuple):
        a: np.ndarray
        b: object

    target = {
        "p": Pair(np.zeros(2), None),
        "o": collections.OrderedDict([("z", np.zeros(1)), ("y", [np.zeros(3), 4])]),
        "t": (np.zeros(1),),
    }
    with_jax = tree.flatten_target(target, is_target_leaf)
    del sys.modules["jax"]  # the JAX-free path (no registered class can exist there)
    try:
        without = tree.flatten_target(target, is_target_leaf)
    finally:
        sys.modules["jax"] = jax
    assert sorted(with_jax.paths) == sorted(without.paths)
    values = {p: str(p) for p in with_jax.paths}
    assert with_jax.rebuild(values) == without.rebuild(values)
    assert type(without.rebuild(values)["p"]) is Pair


def test_importing_snapshard_loads_neither_framework():
    """The top-level names, the safetensors entry points and the CLI import neither JAX nor
    torch: a framework is imported where one of its values is met (`abstract_target`, which
    runs a JAX function abstractly, is JAX's alone)."""
    import subprocess

    code = (
        "import sys, snapshard, snapshard.safetensors, snapshard.cli\n"
        "names = [getattr(snapshard, n) for n in snapshard.__all__ if n != 'abstract_target']\n"
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
