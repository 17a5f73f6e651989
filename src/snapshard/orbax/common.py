"""What both Orbax handlers (the v0 `Handler`, the v1 `CheckpointableHandler`) do with an
item directory: start a snapshard save into it, wait for it, check it, read it back."""

from __future__ import annotations

import os
from typing import Any

from ..errors import SnapshardError
from ..jax.load import load
from ..options import ReadOptions, SaveOptions, require
from ..saving import AsyncSave, SaveTimings, save_async
from ..storage import storage_for


def start_save(directory: os.PathLike[str] | str, tree: Any, options: SaveOptions) -> AsyncSave:
    """The blocking phase of a save into an item directory: every slice this process owns
    copied to the host; writing and committing go on in the background.

    The directory is a fresh temporary one that Orbax made for this save (empty; Orbax
    renames it once every item is committed), so the snapshard checkpoint takes its place
    (`overwrite=True` replaces only an empty directory or a snapshard checkpoint)."""
    require(options, SaveOptions, "save_options")
    return save_async(os.fspath(directory), tree, options, overwrite=True)


class SaveFuture:
    """An Orbax commit future (`result`, `cancel`) over a snapshard save's background phase:
    `result()` returns once the checkpoint is committed on storage, or raises the save's
    error (on every process, whichever process it arose on)."""

    def __init__(self, save: AsyncSave):
        self.save = save

    def result(self, timeout: float | None = None) -> SaveTimings:
        return self.save.wait(timeout)

    def cancel(self) -> bool:
        # A save past its blocking phase runs to its end: its staging area is removed if it
        # fails, and nothing is visible until it commits, so there is nothing to undo.
        return False


def check_committed(directory: os.PathLike[str] | str) -> None:
    """Refuse to let Orbax finalize an item directory that holds no committed snapshard
    checkpoint (its save failed, or did not run)."""
    with storage_for(os.fspath(directory)) as storage:
        if not storage.is_committed():
            raise SnapshardError(
                f"{storage.url}: no committed snapshard checkpoint (manifest.json) in the item "
                "directory; its save did not complete"
            )


def restore(directory: os.PathLike[str] | str, target: Any, options: ReadOptions) -> Any:
    """The item read back: onto the target's shardings, or as NumPy without a target."""
    require(options, ReadOptions, "read_options")
    return load(os.fspath(directory), target, options)
