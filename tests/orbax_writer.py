"""Checkpoints written by orbax-checkpoint itself, for the import tests.

The tree mixes shardings (2-D, 1-D, replicated, one device), dtypes (bf16, int8, bool, ...),
odd shapes, 0-d arrays, Python scalars, a string, None, empty containers and a PRNG key.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# name -> (use_ocdbt, use_zarr3)
LAYOUTS = {
    "ocdbt-zarr": (True, False),
    "ocdbt-zarr3": (True, True),
    "zarr": (False, False),
    "zarr3": (False, True),
}


def random_bytes(shape, dtype, seed):
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).view(dt).reshape(shape)


def host_arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((16, 24), dtype=np.float32),
        "emb": rng.standard_normal((8, 12), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "odd": rng.standard_normal((7, 13), dtype=np.float32),
        "bias": rng.standard_normal((24,), dtype=np.float32),
        "mask": rng.integers(0, 2, (8, 4)).astype(bool),
        "q": rng.integers(-128, 128, (6, 8), dtype=np.int8),
        "counts": np.arange(5, dtype=np.uint32),
        # Finite values only: Orbax's zarr fill value handling rewrites NaN payloads.
        "half": rng.standard_normal((3, 5)).astype(np.float16),
    }


def state_tree() -> dict:
    """The tree saved with Orbax, and (the same tree) the reference for comparisons."""
    from conftest import mesh

    h = host_arrays()
    m = mesh(2, 4)

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(m, P(*spec)))

    return {
        "params": {
            "w": put(h["w"], "data", "model"),
            "emb": put(h["emb"], None, "model"),
            "odd": put(h["odd"]),  # replicated: 7 rows divide no mesh axis
            "bias": put(h["bias"], "model"),
            "layers": [put(h["mask"], "model"), put(h["q"], "data")],
        },
        "opt": {
            "count": jax.device_put(np.int32(12), jax.devices()[0]),
            "half": jax.device_put(h["half"], jax.devices()[1]),
            "empty": {},
            "none": None,
        },
        "host_counts": h["counts"],
        "rng": jax.random.key(11),
        "step": 1000,
        "lr": 0.125,
        "name": "run-7",
    }


def save_pytree(directory: Path, tree, layout: str) -> Path:
    import orbax.checkpoint as ocp

    use_ocdbt, use_zarr3 = LAYOUTS[layout]
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=use_ocdbt, use_zarr3=use_zarr3)
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(directory.absolute(), args=ocp.args.PyTreeSave(tree))
    return directory


def save_manager(directory: Path, trees_by_step: dict[int, dict], *, items=("default",)) -> Path:
    """A CheckpointManager directory; several items per step when `items` has several names."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=len(trees_by_step))
    with ocp.CheckpointManager(directory.absolute(), options=options) as mgr:
        for step, tree in trees_by_step.items():
            if items == ("default",):
                args = ocp.args.StandardSave(tree)
            else:
                args = ocp.args.Composite(**{n: ocp.args.StandardSave(tree[n]) for n in items})
            mgr.save(step, args=args)
        mgr.wait_until_finished()
    return directory
