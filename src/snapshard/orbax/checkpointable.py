"""`CheckpointableHandler`: a checkpointable of Orbax's v1 API
(`orbax.checkpoint.experimental.v1`) saved and loaded as a snapshard checkpoint.

    import orbax.checkpoint.experimental.v1 as ocp_v1

    registry = ocp_v1.handlers.local_registry()
    registry.add(snapshard.orbax.CheckpointableHandler, checkpointable_name="train_state")
    ctx = ocp_v1.Context()
    ctx.checkpointables.registry = registry
    with ctx:
        ocp_v1.save_checkpointables(path, {"train_state": tree})
        state = ocp_v1.load_checkpointables(path, {"train_state": target})["train_state"]

Orbax makes handlers from their class with no arguments, so the options are class
attributes: a subclass sets `save_options` and `read_options` to change them

    class Handler(snapshard.orbax.CheckpointableHandler):
        save_options = snapshard.SaveOptions(compression="zstd")

`save` (the blocking part) waits for the checkpointable's directory (v1 creates it in the
background and lets a handler ask for it early), then copies this process's slices to the
host; the awaitable it returns writes and commits, so the directory holds a committed
snapshard checkpoint before Orbax finalizes the checkpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import SnapshardError
from ..inspection import metadata
from ..options import ReadOptions, SaveOptions
from ..reading.restore import is_target_leaf
from ..saving import AsyncSave
from ..saving.save_array import is_save_leaf
from ..tree import flatten
from . import common


class CheckpointableHandler:
    """Orbax v1 `CheckpointableHandler` whose checkpointable is a snapshard checkpoint: any
    tree `snapshard.save` takes; loaded onto the abstract checkpointable's shardings
    (ShapeDtypeStructs with shardings), or as NumPy without one."""

    save_options: SaveOptions = SaveOptions()
    read_options: ReadOptions = ReadOptions()

    async def _written(self, save: AsyncSave) -> None:
        await asyncio.to_thread(save.wait)

    async def save(self, directory: Any, checkpointable: Any) -> Awaitable[None]:
        path = await directory.await_creation()
        started = common.start_save(path, checkpointable, type(self).save_options)
        return self._written(started)

    async def load(self, directory: Any, abstract_checkpointable: Any = None) -> Awaitable[Any]:
        return asyncio.to_thread(
            common.restore, directory, abstract_checkpointable, type(self).read_options
        )

    async def metadata(self, directory: Any) -> Any:
        return metadata(directory)

    def is_handleable(self, checkpointable: Any) -> bool:
        """A tree snapshard can save (every leaf an array, a Python value or a PRNG key)."""
        return _is_tree_of(checkpointable, is_save_leaf)

    def is_abstract_handleable(self, abstract_checkpointable: Any) -> bool | None:
        """A target `snapshard.load` takes (ShapeDtypeStructs, arrays, Python values)."""
        return _is_tree_of(abstract_checkpointable, is_target_leaf)


def _is_tree_of(tree: Any, is_leaf: Callable[[Any], bool]) -> bool:
    try:
        flatten(tree, is_leaf)
    except (SnapshardError, TypeError, ValueError):
        return False
    return True
