"""snapshard with NumPy alone, in one process where JAX cannot be imported
(SNAPSHARD_TEST_WITHOUT_JAX): save, async save, load with and without a target (plain
containers, a namedtuple, an OrderedDict), per-process values, metadata, the manager.

    numpy_alone.py DIR    reports what came back and whether JAX was imported
"""

from __future__ import annotations

import collections
import os
import sys
from typing import NamedTuple

import workers  # noqa: F401  (first: it blocks JAX before anything can import it)

# isort: split
import numpy as np

import snapshard
from workers._dist import report


class Moments(NamedTuple):
    mu: np.ndarray
    nu: np.ndarray


def main() -> None:
    root = sys.argv[1]
    state = {
        "w": np.arange(12.0, dtype=np.float32).reshape(3, 4),
        "opt": Moments(np.ones(4), np.full(4, 2.0)),
        "layers": collections.OrderedDict([("b", np.arange(3)), ("a", np.arange(2))]),
        "step": 7,
        "cursor": snapshard.PerProcess(11),
        "nothing": None,
    }
    target = {
        "w": np.zeros((3, 4), np.float32),
        "opt": Moments(np.zeros(4), np.zeros(4)),
        "layers": collections.OrderedDict([("b", np.zeros(3, np.int64)), ("a", None)]),
        "step": 0,
        "cursor": snapshard.PerProcess(0),
    }
    sync, later = os.path.join(root, "sync"), os.path.join(root, "async")
    snapshard.save(sync, state)
    snapshard.save_async(later, state).wait()
    got = snapshard.load(sync, target)
    untargeted = snapshard.load(later)
    with snapshard.CheckpointManager(os.path.join(root, "managed")) as m:
        m.save(1, state)
        m.wait_until_finished()
        managed = m.restore(1, target)
    report(
        types=[type(got["opt"]).__name__, type(got["layers"]).__name__],
        w=got["w"].tolist(),
        nu=got["opt"].nu.tolist(),
        layers_keys=list(got["layers"]),
        layers_a=got["layers"]["a"],  # None in the target: an empty subtree, left as it is
        step=got["step"],
        cursor=got["cursor"],
        untargeted_keys=sorted(untargeted),
        untargeted_layers_b=untargeted["layers"]["b"].tolist(),
        managed_equal=bool(np.array_equal(managed["w"], state["w"])),
        metadata_shape=list(snapshard.metadata(sync)["w"].shape),
        jax_imported="jax" in sys.modules,
    )


if __name__ == "__main__":
    main()
