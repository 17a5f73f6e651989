"""snapshard for PyTorch Lightning: a `CheckpointIO` that writes each checkpoint as a
snapshard checkpoint (a directory at the path Lightning names, `epoch=0-step=4.ckpt`).

    trainer = lightning.Trainer(plugins=[snapshard.lightning.CheckpointIO()])
    # saving in a background thread:
    plugins=[snapshard.lightning.AsyncCheckpointIO(snapshard.lightning.CheckpointIO())]

Lightning's checkpoint dict holds tensors and Python objects. Tensors, NumPy arrays and
plain values (`int`, `float`, `bool`, `str`, `None`) in dicts, lists and tuples are stored
as snapshard stores them (no pickle). Any other object (a dict subclass such as
hyper-parameters' `AttributeDict`, a callback's custom object) is pickled into an opaque
`uint8` leaf; loading such a checkpoint needs `CheckpointIO(trust_pickle=True)`, and is
refused otherwise, naming the entries. Needs the `lightning` extra. See
docs/integrations.md.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO as _LightningAsyncCheckpointIO
from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO
from typing_extensions import override

from . import torch as sst
from .options import ReadOptions, SaveOptions
from .tree import ClassesLostWarning

# A pickled object is stored as a dict holding only this key, its bytes a uint8 array.
PICKLED = "__snapshard_pickled__"
_PLAIN = (int, float, bool, str, type(None))


class UntrustedPickleError(ValueError):
    """A checkpoint holds pickled objects and the CheckpointIO was not told to trust it."""


def _encode(value: Any, path: str, pickled: list[str]) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray)) or type(value) in _PLAIN:
        return value
    if type(value) in (dict, OrderedDict):
        if PICKLED in value:
            raise ValueError(f"checkpoint entry {path or '/'} uses the reserved key {PICKLED!r}")
        return {k: _encode(v, f"{path}/{k}", pickled) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_encode(v, f"{path}/{i}", pickled) for i, v in enumerate(value))
    pickled.append(path or "/")
    return {PICKLED: np.frombuffer(pickle.dumps(value), dtype=np.uint8).copy()}


def _pickled_paths(value: Any, path: str = "") -> list[str]:
    if isinstance(value, dict):
        if set(value) == {PICKLED}:
            return [path or "/"]
        return [p for k, v in value.items() for p in _pickled_paths(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _pickled_paths(v, f"{path}/{i}")]
    return []


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {PICKLED}:
            data = value[PICKLED]
            data = data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
            return pickle.loads(data.astype(np.uint8).tobytes())
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v) for v in value)
    return value


def _map(checkpoint: Any, map_location: Any) -> Any:
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


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's whole-state checkpoint IO, writing snapshard checkpoints (atomic, with
    checksums; a directory or an object-store URL). Saving the same path again (Lightning's
    `last.ckpt`) replaces it atomically. `trust_pickle=True` lets loading unpickle the
    objects that were pickled on save (only for checkpoints from a source you trust)."""

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
        pickled: list[str] = []
        state = _encode(checkpoint, "", pickled)
        sst.save(str(path), state, self.options, overwrite=True)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        with warnings.catch_warnings():
            # Lightning's state comes back as plain dicts, which is what it loads from.
            warnings.simplefilter("ignore", ClassesLostWarning)
            state = sst.load(str(path), None, self.read_options)
        names = _pickled_paths(state)
        if names and (not self.trust_pickle or weights_only):
            shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
            why = "weights_only=True was asked" if weights_only else "trust_pickle is not set"
            raise UntrustedPickleError(
                f"{path}: {len(names)} entries hold pickled objects ({shown}) and {why}; "
                "use snapshard.lightning.CheckpointIO(trust_pickle=True) for a checkpoint "
                "from a source you trust"
            )
        return _map(_decode(state), map_location)

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

    def teardown(self) -> None:
        pass


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


__all__ = ["PICKLED", "AsyncCheckpointIO", "CheckpointIO", "UntrustedPickleError"]
