"""The JAX wing's SaveAdapter: trees of jax.Arrays, NumPy arrays and Python values.

The default adapter of `snapshard.save`, `save_async` and the manager's JAX framework.
Importing this module imports no JAX: a jax.Array can only be met once its maker imported
JAX (frameworks.py), and the JAX functions are imported where one is.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DeletedArrayError
from ..format.kinds import LeafKind
from ..frameworks import is_jax_array
from ..planning import WritePlan
from ..saving.save_array import MeshSpec, SaveArray, checked_dtype, classify, is_save_leaf
from ..saving.staging import HostArrays, Snapshot, StagedItem, current_pool, stage
from ..tree import Path


class JaxAdapter:
    """snapshard.saving.SaveAdapter for JAX trees.

    `budget`: the host bytes the blocking phase may copy (SaveOptions.host_budget; the rest
    is copied by the background phase, see saving/staging.py); `snapshot`: the host copy of the
    tree's device arrays when one was already made (the local tier's), staged from instead
    of the devices. The copies made on the host go into buffers of the pool of the save's
    owner (a CheckpointManager's, staging.current_pool), given back when the save ends;
    a save without one allocates them."""

    # A JAX tree is global: every process passes every leaf (an array on a sub-mesh too).
    trees_differ = False

    def __init__(self, budget: int | None = None, snapshot: Snapshot | None = None) -> None:
        self.budget = budget
        self.snapshot = snapshot
        self.pool = current_pool(HostArrays)
        self.borrowed = self.pool.borrower() if self.pool is not None else None

    is_leaf = staticmethod(is_save_leaf)
    classify = staticmethod(classify)

    def stage(
        self, arrays: list[tuple[int, SaveArray]], plan: WritePlan, process: int, *, copy: bool
    ) -> tuple[list[StagedItem], int]:
        return stage(
            arrays, plan, process, budget=self.budget, asynchronous=copy, snapshot=self.snapshot,
            take=self.borrowed.take if self.borrowed is not None else None,
        )  # fmt: skip

    def mesh_of(self, arr: SaveArray) -> MeshSpec | None:
        """A NamedSharding's mesh and partition spec, for the manifest's compact layouts."""
        if not is_jax_array(arr.source):
            return None
        from .arrays import mesh_and_spec

        return mesh_and_spec(arr.source.sharding, len(arr.shape))

    def release(self) -> None:
        """The buffers this save took go back to its owner's pool for the next save (other
        host copies go with their items)."""
        if self.borrowed is not None:
            self.borrowed.release()


# Per sharding, its JSON description (shared by the leaves that have it: never mutated).
_SHARDINGS: dict[Any, dict[str, Any]] = {}


def _sharding_description(sharding: Any) -> dict[str, Any]:
    from .arrays import describe_sharding

    found = _SHARDINGS.get(sharding)
    if found is None:
        found = describe_sharding(sharding)
        if len(_SHARDINGS) >= 4096:
            _SHARDINGS.clear()
        _SHARDINGS[sharding] = found
    return found


# Per (dtype, shape, sharding) of a jax.Array that is not a key: its stored dtype and shape,
# placed layout and sharding description (arrays alike are most of a training state).
_PLACED: dict[tuple[Any, ...], tuple[np.dtype, tuple[int, ...], Any, dict[str, Any]]] = {}


def save_array(path: Path, name: str, value: Any) -> SaveArray:
    from .arrays import is_prng_key, layout_of

    if value.is_deleted():
        raise DeletedArrayError(
            f"leaf {name!r}: the jax.Array was deleted or donated (e.g. passed to a jitted "
            f"function with donate_argnums) before the save; save the array that replaced it"
        )
    known = _PLACED.get((value.dtype, value.shape, value.sharding))
    if known is not None:  # an array like one met before: what follows from the three
        dt, shape, placed, described = known
        return SaveArray(
            path, LeafKind.ARRAY, dt, shape, placed.layout, placed.devices, value, described
        )
    kind, key_impl, data = LeafKind.ARRAY, None, value
    if is_prng_key(value):
        import jax

        kind, key_impl = LeafKind.PRNG_KEY, str(jax.random.key_impl(value))
        data = jax.random.key_data(value)
    dt = np.dtype(data.dtype)
    checked_dtype(dt, name)
    shape = tuple(int(s) for s in data.shape)
    sharding = data.sharding
    placed = layout_of(shape, dt.itemsize, sharding)
    described = _sharding_description(sharding)
    if kind == LeafKind.ARRAY:
        if len(_PLACED) >= 4096:
            _PLACED.clear()
        _PLACED[(value.dtype, value.shape, sharding)] = (dt, shape, placed, described)
    return SaveArray(
        path, kind, dt, shape, placed.layout, placed.devices, data, described, key_impl
    )
