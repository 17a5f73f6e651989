"""snapshard for PyTorch Lightning: a `CheckpointIO` that writes each checkpoint as a
snapshard checkpoint (a directory at the path Lightning names, `epoch=0-step=4.ckpt`).

    trainer = lightning.Trainer(plugins=[snapshard.lightning.CheckpointIO()])
    # saving in a background thread:
    plugins=[snapshard.lightning.AsyncCheckpointIO(snapshard.lightning.CheckpointIO())]
    # sharded state (FSDP2/TP, FSDP): the strategies, which bypass the CheckpointIO
    trainer = lightning.Trainer(strategy=snapshard.lightning.ModelParallelStrategy(...))

Lightning's checkpoint dict holds tensors and Python objects. Tensors, NumPy arrays and
plain values (`int`, `float`, `bool`, `str`, `None`) in dicts, lists and tuples are stored
as snapshard stores them (no pickle). Any other object (a dict subclass such as
hyper-parameters' `AttributeDict`, a callback's custom object) is pickled into an opaque
`uint8` leaf; loading such a checkpoint needs `CheckpointIO(trust_pickle=True)`, and is
refused otherwise, naming the entries. Needs the `lightning` extra. See
docs/integrations.md.
"""

from __future__ import annotations

import io
import pickle
import shutil
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.plugins.io import AsyncCheckpointIO as _LightningAsyncCheckpointIO
from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO
from lightning.pytorch.strategies import FSDPStrategy as _LightningFSDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
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
    """Lightning's checkpoint dict as snapshard leaves and values; `pickled` collects the
    paths of the objects that had to be pickled."""
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


def _refuse_untrusted(
    state: Any, path: Any, trust_pickle: bool, weights_only: bool | None, owner: str
) -> None:
    names = _pickled_paths(state)
    if names and (not trust_pickle or weights_only):
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        why = "weights_only=True was asked" if weights_only else "trust_pickle is not set"
        raise UntrustedPickleError(
            f"{path}: {len(names)} entries hold pickled objects ({shown}) and {why}; "
            f"use snapshard.lightning.{owner}(trust_pickle=True) for a checkpoint "
            "from a source you trust"
        )


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
        _refuse_untrusted(state, path, self.trust_pickle, weights_only, "CheckpointIO")
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


# The entries of a sharded checkpoint: the model's state dict, one per optimizer, and the
# rest of Lightning's dict (loops, callbacks, hyper-parameters) as the bytes of torch.save.
MODEL = "model"
OTHER = "lightning"
_SHARDED = StateDictOptions(full_state_dict=False)


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def save_sharded(
    path: str, checkpoint: dict[str, Any], rank: int, options: SaveOptions = SaveOptions()
) -> None:
    """Write Lightning's checkpoint dict, whose `state_dict` and `optimizer_states` hold
    sharded state dicts (DTensors, ShardedTensors), as one snapshard checkpoint through
    `dcp.save` with snapshard's storage writer: every rank calls it; one commit for all.
    The other entries are pickled by rank 0 alone, as Lightning writes its `meta.pt`."""
    state: dict[str, Any] = {MODEL: checkpoint.pop("state_dict")}
    for i, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[_optimizer_key(i)] = optimizer_state
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        state[OTHER] = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    dcp.save(state, storage_writer=sst.StorageWriter(path, options, overwrite=True))


def load_sharded(
    path: str,
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    strict: bool = True,
    trust_pickle: bool = False,
    weights_only: bool | None = None,
    options: ReadOptions = ReadOptions(),
) -> dict[str, Any]:
    """Restore a checkpoint `save_sharded` wrote into `model` and `optimizers` in place
    (each rank reads the shards it holds, onto any mesh or world size), and return the rest
    of Lightning's dict. Its pickle is read with torch.load's `weights_only` unpickler
    (tensors, containers, plain values) unless `trust_pickle` is set; `weights_only=True`
    keeps it even then."""
    saved = sst.metadata(path)
    if not isinstance(saved, dict) or OTHER not in saved or MODEL not in saved:
        raise ValueError(
            f"{path}: not a Lightning sharded checkpoint written by snapshard "
            f"(no {MODEL!r} and {OTHER!r} entries)"
        )
    state: dict[str, Any] = {MODEL: get_model_state_dict(model, options=_SHARDED)}
    for i, optimizer in enumerate(optimizers):
        state[_optimizer_key(i)] = get_optimizer_state_dict(model, optimizer, options=_SHARDED)
    state[OTHER] = torch.empty(saved[OTHER].shape, dtype=torch.uint8)
    dcp.load(state, storage_reader=sst.StorageReader(path, options))
    set_model_state_dict(model, state[MODEL], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[_optimizer_key(i)], options=_SHARDED)
    restricted = weights_only or not trust_pickle
    try:
        rest = torch.load(io.BytesIO(state[OTHER].numpy().tobytes()), weights_only=restricted)
    except pickle.UnpicklingError as e:
        raise UntrustedPickleError(
            f"{path}: Lightning's entries ({OTHER!r}) hold objects torch.load's weights_only "
            "unpickler refuses; pass trust_pickle=True to the strategy for a checkpoint from "
            f"a source you trust ({e})"
        ) from e
    if not isinstance(rest, dict):
        raise ValueError(f"{path}: entry {OTHER!r} is not Lightning's checkpoint dict")
    return rest


def _lightning_layout(path: str) -> bool:
    """A checkpoint in Lightning's own layout: a file, or a directory with its meta.pt."""
    local = Path(path)
    return "://" not in path and (local.is_file() or (local / "meta.pt").is_file())


class _ShardedCheckpoints:
    """What the two strategies share: their sharded checkpoints through snapshard. Mixed in
    before Lightning's strategy class, whose methods `super()` reaches."""

    def __init__(
        self,
        *args: Any,
        options: SaveOptions = SaveOptions(),
        read_options: ReadOptions = ReadOptions(),
        trust_pickle: bool = False,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.snapshard_options = options
        self.snapshard_read_options = read_options
        self.trust_pickle = trust_pickle

    def _sharded(self) -> bool:
        """Whether the strategy writes distributed checkpoints (else Lightning's file)."""
        raise NotImplementedError

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        strategy: Any = self  # a Lightning strategy: the class this is mixed into
        if not self._sharded() or storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        path = str(strategy.broadcast(str(filepath)))
        if "://" not in path and Path(path).is_file():
            if strategy.global_rank == 0:
                Path(path).unlink()  # a full checkpoint saved there before
            strategy.barrier()
        save_sharded(path, checkpoint, strategy.global_rank, self.snapshard_options)
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        strategy: Any = self
        path = str(strategy.broadcast(str(checkpoint_path)))
        if _lightning_layout(path):
            return super().load_checkpoint(checkpoint_path, weights_only)  # type: ignore[misc]
        module = strategy.lightning_module
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [getattr(o, "_optimizer", o) for o in strategy.optimizers] if fitting else []
        return load_sharded(
            path,
            strategy.model,
            optimizers,
            strict=module.strict_loading,
            trust_pickle=self.trust_pickle,
            weights_only=weights_only,
            options=self.snapshard_read_options,
        )


class ModelParallelStrategy(_ShardedCheckpoints, _LightningModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2, tensor parallelism), with its distributed
    checkpoints written and read by snapshard: `Trainer.save_checkpoint` and
    `ModelCheckpoint` write one snapshard checkpoint (atomic, checksummed, restorable onto
    another mesh) through DCP with snapshard's storage; checkpoints in Lightning's own layout
    still load. `save_distributed_checkpoint=False` keeps Lightning's full-state file.
    Takes Lightning's arguments and `options`, `read_options`, `trust_pickle`."""

    def _sharded(self) -> bool:
        return bool(self._save_distributed_checkpoint)


class FSDPStrategy(_ShardedCheckpoints, _LightningFSDPStrategy):
    """Lightning's FSDPStrategy, with `state_dict_type="sharded"` checkpoints written and
    read by snapshard, as `ModelParallelStrategy` here does; `"full"` keeps Lightning's
    file. Lightning runs this strategy on GPUs only."""

    def _sharded(self) -> bool:
        return self._state_dict_type == "sharded"


__all__ = [
    "MODEL",
    "OTHER",
    "PICKLED",
    "AsyncCheckpointIO",
    "CheckpointIO",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "UntrustedPickleError",
    "load_sharded",
    "save_sharded",
]
