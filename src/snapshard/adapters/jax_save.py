"""The JAX wing's SaveAdapter: trees of jax.Arrays, NumPy arrays and Python values.

The default adapter of `snapshard.save`, `save_async` and the manager's JAX framework.
Importing this module imports no JAX: a jax.Array can only be met once its maker imported
JAX (adapters/loaded.py), and the JAX functions are imported where one is.
"""

from __future__ import annotations

from typing import Any

from ..format.manifest import Leaf
from ..planning import WritePlan
from ..staging import Snapshot, StagedItem, stage
from ..tree import Path
from .leaves import MeshSpec, SaveArray, classify, is_save_leaf
from .loaded import is_jax_array


class JaxAdapter:
    """snapshard.saving.SaveAdapter for JAX trees.

    `budget`: the host bytes the blocking phase may copy (SaveOptions.host_budget; the rest
    is copied by the background phase, see staging.py); `snapshot`: the host copy of the
    tree's device arrays when one was already made (the local tier's), staged from instead
    of the devices."""

    def __init__(self, budget: int | None = None, snapshot: Snapshot | None = None) -> None:
        self.budget = budget
        self.snapshot = snapshot

    def is_leaf(self, x: Any) -> bool:
        return is_save_leaf(x)

    def classify(self, path: Path, value: Any, process_count: int) -> Leaf | SaveArray:
        return classify(path, value, process_count)

    def stage(
        self, arrays: list[tuple[int, SaveArray]], plan: WritePlan, process: int, *, copy: bool
    ) -> tuple[list[StagedItem], int]:
        return stage(
            arrays, plan, process, budget=self.budget, asynchronous=copy, snapshot=self.snapshot
        )

    def mesh_of(self, arr: SaveArray) -> MeshSpec | None:
        """A NamedSharding's mesh and partition spec, for the manifest's compact layouts."""
        if not is_jax_array(arr.source):
            return None
        from .jax_arrays import mesh_and_spec

        return mesh_and_spec(arr.source.sharding, len(arr.shape))

    def release(self) -> None:
        """Nothing to give back: staged host copies go with their items."""
