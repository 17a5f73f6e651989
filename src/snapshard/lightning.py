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

Switching a running job: a checkpoint Lightning wrote before the switch (its own `.ckpt`
file, written with torch.save) still loads, through the CheckpointIO and the strategies
(`trainer.fit(model, ckpt_path="last.ckpt")`). It is read with torch.load's `weights_only`
unpickler, as Lightning reads its own files by default: tensors, containers, plain values
and the types Lightning registers as safe, which is all of Lightning's own dict. Anything
beyond that (a custom object in the hyper-parameters or a callback's state) runs code when
unpickled, so it is refused, naming the file, unless `trust_pickle=True` says the file is
the user's own; `weights_only=True` keeps the refusal. The next save to that path (the
`last.ckpt` of `ModelCheckpoint`) replaces the file with a snapshard checkpoint in one
step: the old file stays whole and readable until the new checkpoint commits.
`load_from_checkpoint(cls, path)` is `LightningModule.load_from_checkpoint` for snapshard
checkpoints (and Lightning's files); `to_lightning_file(path, out)` writes a snapshard
checkpoint back as a Lightning file, the way back.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import LightningModule
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
from .dtypes import dtype_from_name
from .errors import CheckpointNotFoundError
from .inspection import ArrayMetadata, ValueMetadata
from .options import ReadOptions, SaveOptions
from .storage.atomic_rename import fsync_dir, move_into_place
from .storage.stale_staging import STAGING_SUFFIX
from .torch.dtypes import torch_dtype
from .tree import ClassesLostWarning

# A pickled object is stored as a dict holding only this key, its bytes a uint8 array.
PICKLED = "__snapshard_pickled__"
_PLAIN = (int, float, bool, str, type(None))


class UntrustedPickleError(ValueError):
    """A checkpoint holds pickled objects and the CheckpointIO was not told to trust it."""


def _encode(value: Any, path: str) -> Any:
    """Lightning's checkpoint dict as snapshard leaves and values, other objects pickled."""
    if isinstance(value, (torch.Tensor, np.ndarray)) or type(value) in _PLAIN:
        return value
    if type(value) in (dict, OrderedDict):
        if PICKLED in value:
            raise ValueError(f"checkpoint entry {path or '/'} uses the reserved key {PICKLED!r}")
        return {k: _encode(v, f"{path}/{k}") for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_encode(v, f"{path}/{i}") for i, v in enumerate(value))
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


def _local_file(text: str) -> bool:
    """A file on the local filesystem: what Lightning's own CheckpointIO writes (a snapshard
    checkpoint is a directory, or a prefix on an object store)."""
    return "://" not in text and Path(text).is_file()


def _remote_file(text: str) -> bool:
    """An object at `text` that Lightning's own CheckpointIO could have written there (it
    writes URLs through fsspec); asked only where no snapshard checkpoint is."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(text)
        return bool(fs.isfile(root))
    except (ImportError, ValueError, OSError):
        # No fsspec filesystem for the scheme, or no access: the caller's error stands.
        return False


def _unpickler_reason(error: Exception) -> str:
    """The line of torch.load's weights_only refusal that names the refused object."""
    lines = str(error).splitlines()
    named = [line for line in lines if "Unsupported global" in line or "Unpickler error" in line]
    return (named or lines or [type(error).__name__])[0].strip()


def _load_lightning_file(
    path: str, map_location: Any, weights_only: bool | None, trust_pickle: bool, owner: str
) -> dict[str, Any]:
    """A checkpoint Lightning wrote as a file (torch.save), read as Lightning reads it
    (fsspec, torch.load), with torch.load's weights_only unpickler unless `trust_pickle` is
    set (and `weights_only=True` keeps it even then)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    restricted = bool(weights_only) or not trust_pickle
    try:
        with fs.open(root, "rb") as f:
            checkpoint = torch.load(f, map_location=map_location, weights_only=restricted)
    except pickle.UnpicklingError as e:
        raise UntrustedPickleError(
            f"{path}: this Lightning checkpoint file holds objects torch.load's weights_only "
            f"unpickler refuses ({_unpickler_reason(e)}); use snapshard.lightning.{owner}"
            "(trust_pickle=True) for a file from a source you trust"
        ) from e
    if not isinstance(checkpoint, dict):
        raise ValueError(
            f"{path}: not a Lightning checkpoint (torch.load gave a {type(checkpoint).__name__}, "
            "not Lightning's dict)"
        )
    return checkpoint


def _save_target(path: str) -> str:
    """Where a save meant for `path` writes: `path`, or, where a checkpoint in Lightning's
    own layout is (written before the switch: a file, or a strategy's directory with its
    `meta.pt`; ModelCheckpoint's `last.ckpt` at the first save after it), a staging name
    beside it, which `move_into_place` then puts in the old one's place in one step."""
    if not _lightning_layout(path):
        return path
    final = Path(path)
    return str(final.with_name(final.name + STAGING_SUFFIX + "-lightning"))


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's whole-state checkpoint IO, writing snapshard checkpoints (atomic, with
    checksums; a directory or an object-store URL). Saving the same path again (Lightning's
    `last.ckpt`) replaces it atomically, a file Lightning wrote there before the switch
    included. `trust_pickle=True` lets loading unpickle the objects that were pickled on
    save (only for checkpoints from a source you trust). Loading also reads Lightning's own
    `.ckpt` files, as the module docstring says."""

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
        state = _encode(checkpoint, "")
        target = _save_target(str(path))
        sst.save(target, state, self.options, overwrite=True)
        if target != str(path):
            move_into_place(Path(target), Path(path), replace=True)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        text = str(path)
        if _local_file(text):  # written by Lightning before the switch
            return _load_lightning_file(
                text, map_location, weights_only, self.trust_pickle, "CheckpointIO"
            )
        try:
            with warnings.catch_warnings():
                # Lightning's state comes back as plain dicts, which is what it loads from.
                warnings.simplefilter("ignore", ClassesLostWarning)
                state = sst.load(text, None, self.read_options)
        except CheckpointNotFoundError:
            if "://" in text and _remote_file(text):
                return _load_lightning_file(
                    text, map_location, weights_only, self.trust_pickle, "CheckpointIO"
                )
            raise
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
    return _unpickle_rest(path, state[OTHER], trust_pickle, weights_only, "the strategy")


def _unpickle_rest(
    path: str, data: torch.Tensor, trust_pickle: bool, weights_only: bool | None, owner: str
) -> dict[str, Any]:
    """The rest of Lightning's dict from its `torch.save` bytes (the `lightning` entry of a
    sharded checkpoint): torch.load's weights_only unpickler unless `trust_pickle` is set,
    and `weights_only=True` keeps it even then. `owner` is what takes `trust_pickle`."""
    restricted = bool(weights_only) or not trust_pickle
    try:
        rest = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=restricted)
    except pickle.UnpicklingError as e:
        raise UntrustedPickleError(
            f"{path}: Lightning's entries ({OTHER!r}) hold objects torch.load's weights_only "
            f"unpickler refuses; pass trust_pickle=True to {owner} for a checkpoint from "
            f"a source you trust ({e})"
        ) from e
    if not isinstance(rest, dict):
        raise ValueError(f"{path}: entry {OTHER!r} is not Lightning's checkpoint dict")
    return rest


def _sharded_layout(saved: Any) -> bool:
    """The metadata tree of a checkpoint `save_sharded` wrote (not the CheckpointIO's dict)."""
    return (
        isinstance(saved, dict) and MODEL in saved and OTHER in saved and "state_dict" not in saved
    )


def _empty_like(saved: Any, path: str, where: str) -> Any:
    """CPU tensors of the saved shapes and dtypes, a target for snapshard.torch.load that
    reads each tensor whole; plain values as saved."""
    if isinstance(saved, dict):
        return {k: _empty_like(v, path, f"{where}/{k}") for k, v in saved.items()}
    if isinstance(saved, ArrayMetadata):
        dtype = torch_dtype(dtype_from_name(saved.dtype))
        if dtype is None:
            raise TypeError(f"{path}: leaf {where!r} has dtype {saved.dtype}, which torch lacks")
        return torch.empty(saved.shape, dtype=dtype)
    if isinstance(saved, ValueMetadata):
        return saved.value
    raise TypeError(
        f"{path}: leaf {where!r} is a {type(saved).__name__}, which a model's state dict "
        "does not hold"
    )


def _module_checkpoint(
    path: str,
    map_location: Any,
    weights_only: bool | None,
    trust_pickle: bool,
    read_options: ReadOptions,
    owner: str,
) -> dict[str, Any]:
    """Lightning's checkpoint dict with the model's whole tensors in `state_dict`, from any
    checkpoint snapshard.lightning reads: the CheckpointIO's (the whole dict), the
    strategies' (the model's state dict, gathered whole, and Lightning's other entries; the
    optimizers' sharded states are not read) or a file Lightning wrote itself."""
    whole = CheckpointIO(read_options=read_options, trust_pickle=trust_pickle)
    try:
        saved = sst.metadata(path)
    except CheckpointNotFoundError:
        # Lightning's own file, or the same error again from the CheckpointIO
        return whole.load_checkpoint(path, map_location, weights_only)
    if not _sharded_layout(saved):
        return whole.load_checkpoint(path, map_location, weights_only)
    target = {
        MODEL: _empty_like(saved[MODEL], path, MODEL),
        OTHER: torch.empty(saved[OTHER].shape, dtype=torch.uint8),
    }
    got = sst.load(path, target, read_options)
    checkpoint = _unpickle_rest(path, got[OTHER], trust_pickle, weights_only, owner)
    checkpoint["state_dict"] = _map(got[MODEL], map_location)
    return checkpoint


_Module = TypeVar("_Module", bound=LightningModule)


def load_from_checkpoint(
    cls: type[_Module],
    path: Any,
    map_location: Any | None = None,
    hparams_file: Any | None = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    *,
    trust_pickle: bool = False,
    read_options: ReadOptions = ReadOptions(),
    **kwargs: Any,
) -> _Module:
    """`cls.load_from_checkpoint(path, ...)` for the checkpoints snapshard.lightning writes,
    which Lightning's own cannot open (they are directories): a module of class `cls` built
    from the checkpoint's hyper-parameters (overridden by `kwargs`, or replaced by those of
    `hparams_file`, a .yaml or .csv), with its weights loaded as Lightning loads them (its
    `configure_model` and `on_load_checkpoint` hooks run; `strict`, else the module's
    `strict_loading`), and moved to the device of the loaded tensors (CPU, or `map_location`:
    a device or a device name).

    Reads the CheckpointIO's checkpoints, the strategies' (only the model's entries and
    Lightning's: the whole model is gathered in this process, the optimizers are not read)
    and Lightning's own `.ckpt` files. Pickled entries are refused as the CheckpointIO
    refuses them, unless `trust_pickle` (and not `weights_only=True`)."""
    from lightning.pytorch.core.saving import (
        _load_state,
        load_hparams_from_tags_csv,
        load_hparams_from_yaml,
    )
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise TypeError(
            f"snapshard.lightning.load_from_checkpoint({str(path)!r}): {cls!r} is not a "
            "LightningModule class"
        )
    text = str(path)
    checkpoint = _module_checkpoint(
        text, map_location, weights_only, trust_pickle, read_options, "load_from_checkpoint"
    )
    # The keys of older Lightning versions, renamed as Lightning's own loader does.
    checkpoint = _pl_migrate_checkpoint(checkpoint)
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY
    if hparams_file is not None:
        extension = str(hparams_file).rsplit(".", 1)[-1].lower()
        if extension == "csv":
            checkpoint[key] = load_hparams_from_tags_csv(hparams_file)
        elif extension in ("yml", "yaml"):
            checkpoint[key] = load_hparams_from_yaml(hparams_file)
        else:
            raise ValueError(f"{hparams_file}: hparams_file must be a .csv, .yml or .yaml file")
    checkpoint.setdefault(key, {}).update(kwargs)
    model = cast(_Module, _load_state(cls, checkpoint, strict=strict, **kwargs))
    tensors = (t for t in checkpoint["state_dict"].values() if isinstance(t, torch.Tensor))
    first = next(tensors, None)
    return model if first is None else model.to(first.device)


def to_lightning_file(
    path: Any,
    out: Any,
    *,
    trust_pickle: bool = False,
    read_options: ReadOptions = ReadOptions(),
) -> None:
    """Write the snapshard checkpoint at `path` (one snapshard.lightning wrote) as a file in
    Lightning's own format at `out` (torch.save, what Lightning's default CheckpointIO
    writes and reads): the way back from the switch. A CheckpointIO checkpoint gives the
    whole dict, from which `trainer.fit(ckpt_path=out)` resumes without the plugin; a
    strategy's gives the model's full weights and Lightning's entries but not the
    optimizers' states (they are saved sharded, by parameter name), so that file serves
    `LightningModule.load_from_checkpoint` and evaluation, not a resumed fit. The file
    appears whole or not at all (written beside `out`, synced, renamed). Holds the model in
    host memory. Pickled entries need `trust_pickle`, as on load."""
    checkpoint = _module_checkpoint(
        str(path), None, None, trust_pickle, read_options, "to_lightning_file"
    )
    final = Path(out)
    staged = final.with_name(final.name + STAGING_SUFFIX)
    try:
        with open(staged, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, final)
    finally:
        staged.unlink(missing_ok=True)  # a failed write's partial file; gone after replace
    fsync_dir(final.parent)


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
        # A file there (Lightning's, before the switch, or a full-state save) is replaced
        # once the checkpoint has committed beside it; rank 0's view decides for all.
        target = str(strategy.broadcast(_save_target(path)))
        save_sharded(target, checkpoint, strategy.global_rank, self.snapshard_options)
        if target != path:
            if strategy.global_rank == 0:
                move_into_place(Path(target), Path(path), replace=True)
            strategy.barrier()
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
    "load_from_checkpoint",
    "load_sharded",
    "save_sharded",
    "to_lightning_file",
]
