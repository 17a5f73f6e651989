"""`Handler`: an Orbax `AsyncCheckpointHandler` whose items are snapshard checkpoints.

Orbax calls the handler on every process with the same item directory (a temporary one
inside the step's temporary directory, which Orbax renames once every process's futures are
done); snapshard's save is collective the same way, over jax.distributed.

- `async_save`: the blocking part waits until Orbax has made the item directory (with
  asynchronous directory creation, a signal from the primary process, usually already
  given), then runs snapshard's blocking phase: the device-to-host copy of every slice
  this process owns. The returned future completes the save: data files written, process
  0 commits (manifest.json written last, the staging directory renamed into place), and
  every process learns the outcome. So the item is a complete snapshard checkpoint before
  Orbax's `finalize` renames anything; `finalize` checks it.
- `restore`: `snapshard.load` onto the target's shardings (any mesh, device or process
  count), or NumPy without a target.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

from ..inspection import metadata
from ..options import ReadOptions, SaveOptions, require
from ..saving import AsyncSave
from . import common


async def _directory_made() -> None:
    """Nothing: run by a commit future once the awaited signals (directory creation) are in."""


def wait_for_directory() -> None:
    """Wait for the signals Orbax's contract for this save names (the creation of the step's
    and items' temporary directories, made by the primary process in the background when
    directories are created asynchronously); returns at once where there are none."""
    ocp.future.CommitFutureAwaitingContractedSignals(
        _directory_made(), name="snapshard: item directory"
    ).result()


class Handler(ocp.handlers.AsyncCheckpointHandler):
    """An Orbax checkpoint handler writing and reading an item as a snapshard checkpoint.

    `save_options` (snapshard.SaveOptions) and `read_options` (snapshard.ReadOptions) apply
    to every save and restore through this handler. Use with `Save(tree)` and
    `Restore(target)` as the item's args.
    """

    def __init__(
        self,
        *,
        save_options: SaveOptions = SaveOptions(),
        read_options: ReadOptions = ReadOptions(),
    ) -> None:
        require(save_options, SaveOptions, "save_options")
        require(read_options, ReadOptions, "read_options")
        self.save_options = save_options
        self.read_options = read_options
        self._inflight: AsyncSave | None = None

    def _start(self, directory: epath.Path, args: Save) -> list[common.SaveFuture]:
        if not isinstance(args, Save):
            raise TypeError(
                f"snapshard.orbax.Handler saves with snapshard.orbax.Save(tree), not {type(args).__name__}"
            )
        wait_for_directory()
        self._inflight = common.start_save(directory, args.tree, self.save_options)
        return [common.SaveFuture(self._inflight)]

    async def async_save(self, directory: epath.Path, args: Save) -> list[common.SaveFuture]:
        """Blocking: the host copy of this process's slices. The futures write and commit."""
        return self._start(directory, args)

    def save(self, directory: epath.Path, args: Save) -> None:
        """A whole save: returns once the item is committed."""
        for f in self._start(directory, args):
            f.result()

    def restore(self, directory: epath.Path, args: Restore | None = None) -> Any:
        if args is not None and not isinstance(args, Restore):
            raise TypeError(
                "snapshard.orbax.Handler restores with snapshard.orbax.Restore(target), "
                f"not {type(args).__name__}"
            )
        target = None if args is None else args.target
        return common.restore(directory, target, self.read_options)

    def metadata(self, directory: epath.Path) -> Any:
        return metadata(directory)

    def finalize(self, directory: epath.Path) -> None:
        common.check_committed(directory)

    def close(self) -> None:
        """Wait for a save still being written (its error, if any, was raised to Orbax
        through its future)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            with contextlib.suppress(Exception):  # raised through the save's future already
                inflight.wait()

    @classmethod
    def typestr(cls) -> str:
        return "snapshard.orbax.Handler"


@ocp.args.register_with_handler(Handler, for_save=True)
@dataclass  # CheckpointArgs is a plain (not frozen) dataclass
class Save(ocp.args.CheckpointArgs):
    """The args of an item saved through `Handler`: the tree, as `snapshard.save` takes it
    (jax.Arrays with any sharding, NumPy arrays, Python values, PRNG keys, PerProcess)."""

    tree: Any


@ocp.args.register_with_handler(Handler, for_restore=True)
@dataclass  # CheckpointArgs is a plain (not frozen) dataclass
class Restore(ocp.args.CheckpointArgs):
    """The args of an item restored through `Handler`: the target as `snapshard.load`
    takes it (ShapeDtypeStructs with shardings, jax.Arrays, NumPy arrays), or None for the
    saved tree as NumPy arrays and Python values."""

    target: Any = None
