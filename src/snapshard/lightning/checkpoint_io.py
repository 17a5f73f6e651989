"""Lightning's `CheckpointIO` plugin, writing whole-state snapshard checkpoints, and its
`AsyncCheckpointIO` with removals queued behind the saves."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO as _LightningAsyncCheckpointIO
from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO
from typing_extensions import override

from .. import torch as sst
from ..coordination.base import SingleProcessCoordinator
from ..errors import CheckpointNotFoundError
from ..options import ReadOptions, SaveOptions
from ..storage.atomic_rename import move_into_place
from ..tree import ClassesLostWarning
from .migration import load_lightning_file, local_file, remote_file, save_target
from .pickled import decode, encode, refuse_untrusted


def mapped(checkpoint: Any, map_location: Any) -> Any:
    """The checkpoint with its tensors moved to `map_location` (None: where they are)."""
    if map_location is None:
        return checkpoint
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
    else:
        raise TypeError(
            "snapshard.lightning.CheckpointIO: map_location must be a device or a device name, "
            f"not {type(map_location).__name__}"
        )

    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(move(x) for x in v)
        return v

    return move(checkpoint)


_ALONE = SingleProcessCoordinator()


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's whole-state checkpoint IO, writing snapshard checkpoints (atomic, with
    checksums; a directory or an object-store URL). Saving the same path again (Lightning's
    `last.ckpt`) replaces it atomically, a file Lightning wrote there before the switch
    included. `trust_pickle=True` lets loading unpickle the objects that were pickled on
    save (only for checkpoints from a source you trust). Loading also reads Lightning's own
    `.ckpt` files (migration.py)."""

    def __init__(
        self,
        options: SaveOptions = SaveOptions(),
        read_options: ReadOptions = ReadOptions(),
        *,
        trust_pickle: bool = False,
    ):
        self.options = options
        self.read_options = read_options
        self.trust_pickle = trust_pickle

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"snapshard.lightning.CheckpointIO.save_checkpoint({str(path)!r}): "
                "storage_options is not supported; pass SaveOptions to CheckpointIO(options=...)"
            )
        state = encode(checkpoint, "")
        target = save_target(str(path))
        # Lightning calls this on global rank 0 alone (its whole state, gathered there): a
        # save of one process, whatever the job's process group.
        sst.save(target, state, self.options, overwrite=True, coordinator=_ALONE)
        if target != str(path):
            move_into_place(Path(target), Path(path), replace=True)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        text = str(path)
        if local_file(text):  # written by Lightning before the switch
            return load_lightning_file(
                text, map_location, weights_only, self.trust_pickle, "CheckpointIO"
            )
        try:
            with warnings.catch_warnings():
                # Lightning's state comes back as plain dicts, which is what it loads from.
                warnings.simplefilter("ignore", ClassesLostWarning)
                state = sst.load(text, None, self.read_options)
        except CheckpointNotFoundError:
            if "://" in text and remote_file(text):
                return load_lightning_file(
                    text, map_location, weights_only, self.trust_pickle, "CheckpointIO"
                )
            raise
        refuse_untrusted(state, path, self.trust_pickle, weights_only, "CheckpointIO")
        return mapped(decode(state), map_location)

    def remove_checkpoint(self, path: Any) -> None:
        text = str(path)
        if "://" in text:
            import fsspec

            fs, root = fsspec.core.url_to_fs(text)
            if fs.exists(root):
                fs.rm(root, recursive=True)
            return
        target = Path(text)
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)


class AsyncCheckpointIO(_LightningAsyncCheckpointIO):
    """Lightning's AsyncCheckpointIO (saves in a background thread), with removals queued
    behind the saves: Lightning's own removes at once, so `ModelCheckpoint(save_top_k=...)`
    may remove a checkpoint whose save has not run yet, which then appears afterwards and
    stays. Loading waits for the saves in flight."""

    @override
    def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self._ensure_setup()
        assert self._executor is not None and self.checkpoint_io is not None
        inner = self.checkpoint_io

        def remove() -> None:
            try:
                inner.remove_checkpoint(*args, **kwargs)
            except BaseException as ex:
                self._error = ex

        self._executor.submit(remove)
        if self._error:
            raise self._error

    @override
    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if self._executor is not None:
            self._executor.submit(lambda: None).result()
        if self._error:
            raise self._error
        return super().load_checkpoint(*args, **kwargs)
