"""snapshard for Hugging Face Accelerate: `accelerator.save_state(dir)` / `load_state(dir)`
store the models' weights as one snapshard checkpoint, `dir/snapshard_models`.

    handles = snapshard.accelerate.use_snapshard(accelerator)   # once, after creating it

The switch goes through Accelerate's own seams, `register_save_state_pre_hook` and
`register_load_state_pre_hook`: the save hook writes the state dicts Accelerate is about to
write and takes them out of its list (so no `model.safetensors` is written); the load hook
fills the models in place and takes them out of its list. Accelerate passes its hooks the
models only: optimizers, schedulers, samplers, the RNG states and custom objects are still
written by Accelerate itself (`optimizer.bin` and the rest, with torch.save).

FSDP's sharded state (`SHARDED_STATE_DICT`) does not go through those hooks: Accelerate
calls `save_fsdp_model` / `save_fsdp_optimizer` (and the loads), which write with DCP's
`FileSystemWriter`. `use_snapshard` replaces those four functions where Accelerate looks
them up, for the accelerators it was given only: theirs write each model and optimizer as a
snapshard checkpoint through DCP with snapshard's storage (same directory names); any other
accelerator, state-dict type or option goes to Accelerate's own functions. Needs the
`accelerate` extra. See docs/integrations.md.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from . import torch as sst
from .options import ReadOptions, SaveOptions

NAME = "snapshard_models"


def _key(i: int) -> str:
    return f"model_{i}"


def save_hook(options: SaveOptions = SaveOptions()) -> Any:
    """The hook for `Accelerator.register_save_state_pre_hook`: the models' state dicts
    Accelerate gathered go to `output_dir/snapshard_models` (every process calls it, as
    snapshard.torch.save wants); the list is emptied so Accelerate writes no weights."""

    def hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if not weights:
            return
        state = {_key(i): w for i, w in enumerate(weights)}
        sst.save(os.path.join(output_dir, NAME), state, options, overwrite=True)
        weights.clear()

    return hook


def load_hook(read_options: ReadOptions = ReadOptions()) -> Any:
    """The hook for `Accelerator.register_load_state_pre_hook`: each model's state dict is
    filled in place from `input_dir/snapshard_models`; the list is emptied so Accelerate
    looks for no weights files. A directory without that checkpoint is left to Accelerate
    (one saved without snapshard)."""

    def hook(models: list[Any], input_dir: str) -> None:
        if not models:
            return
        path = os.path.join(input_dir, NAME)
        if not os.path.isdir(path) and "://" not in str(input_dir):
            return
        target = {_key(i): m.state_dict() for i, m in enumerate(models)}
        sst.load(path, target, read_options)
        models.clear()

    return hook


@dataclass(frozen=True)
class _Switch:
    options: SaveOptions
    read_options: ReadOptions


# The accelerators use_snapshard was given, with their options.
_SWITCHED: weakref.WeakKeyDictionary[Any, _Switch] = weakref.WeakKeyDictionary()
_SHARDED = StateDictOptions(full_state_dict=False)


def _ours(fsdp_plugin: Any, accelerator: Any, use_dcp: bool, adapter_only: bool = False) -> bool:
    from torch.distributed.fsdp import StateDictType

    return (
        accelerator in _SWITCHED
        and use_dcp
        and not adapter_only
        and fsdp_plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    )


def _plain_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under Accelerate's wrappers (`AcceleratedOptimizer.optimizer`):
    torch's state-dict functions may step an empty optimizer, which must not step a
    wrapper's gradient scaler."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _is_snapshard(path: str) -> bool:
    return "://" in path or os.path.isfile(os.path.join(path, "manifest.json"))


def _save(accelerator: Any, path: str, state: dict[str, Any]) -> None:
    writer = sst.StorageWriter(path, _SWITCHED[accelerator].options, overwrite=True)
    dcp.save(state, storage_writer=writer)


def _load(accelerator: Any, path: str, state: dict[str, Any]) -> None:
    dcp.load(state, storage_reader=sst.StorageReader(path, _SWITCHED[accelerator].read_options))


# Accelerate's own FSDP functions, where each call that is not ours goes.
_ORIGINALS: dict[str, Callable[..., Any]] = {}
_NAMES = ("save_fsdp_model", "load_fsdp_model", "save_fsdp_optimizer", "load_fsdp_optimizer")


def _model_dir(directory: str, index: int) -> str:
    from accelerate.utils.constants import FSDP_MODEL_NAME

    return os.path.join(directory, f"{FSDP_MODEL_NAME}_{index}")


def _optimizer_dir(directory: str, index: int) -> str:
    from accelerate.utils.constants import OPTIMIZER_NAME

    return os.path.join(directory, f"{OPTIMIZER_NAME}_{index}")


def save_fsdp_model(
    fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: str, model_index: int = 0,
    adapter_only: bool = False, use_dcp: bool = True,
) -> Any:  # fmt: skip
    """Accelerate's `save_fsdp_model`, through snapshard for a switched accelerator."""
    if not _ours(fsdp_plugin, accelerator, use_dcp, adapter_only):
        return _ORIGINALS["save_fsdp_model"](
            fsdp_plugin, accelerator, model, output_dir, model_index, adapter_only, use_dcp
        )
    state = {"model": get_model_state_dict(model, options=_SHARDED)}
    _save(accelerator, _model_dir(output_dir, model_index), state)
    return None


def load_fsdp_model(
    fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: str, model_index: int = 0,
    adapter_only: bool = False, use_dcp: bool = True,
) -> Any:  # fmt: skip
    """Accelerate's `load_fsdp_model`, through snapshard for a switched accelerator and a
    snapshard checkpoint (one Accelerate wrote itself goes to Accelerate's)."""
    path = _model_dir(input_dir, model_index)
    if not _ours(fsdp_plugin, accelerator, use_dcp, adapter_only) or not _is_snapshard(path):
        return _ORIGINALS["load_fsdp_model"](
            fsdp_plugin, accelerator, model, input_dir, model_index, adapter_only, use_dcp
        )
    state = {"model": get_model_state_dict(model, options=_SHARDED)}
    _load(accelerator, path, state)
    result = set_model_state_dict(model, state["model"], options=_SHARDED)
    accelerator.wait_for_everyone()
    return result


def save_fsdp_optimizer(
    fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, output_dir: str,
    optimizer_index: int = 0, use_dcp: bool = True,
) -> None:  # fmt: skip
    """Accelerate's `save_fsdp_optimizer`, through snapshard for a switched accelerator."""
    if not _ours(fsdp_plugin, accelerator, use_dcp):
        return _ORIGINALS["save_fsdp_optimizer"](
            fsdp_plugin, accelerator, optimizer, model, output_dir, optimizer_index, use_dcp
        )
    plain = _plain_optimizer(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, plain, options=_SHARDED)}
    _save(accelerator, _optimizer_dir(output_dir, optimizer_index), state)
    return None


def load_fsdp_optimizer(
    fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, input_dir: str,
    optimizer_index: int = 0, adapter_only: bool = False, use_dcp: bool = True,
) -> None:  # fmt: skip
    """Accelerate's `load_fsdp_optimizer`, through snapshard as `load_fsdp_model` is."""
    path = _optimizer_dir(input_dir, optimizer_index)
    if not _ours(fsdp_plugin, accelerator, use_dcp, adapter_only) or not _is_snapshard(path):
        return _ORIGINALS["load_fsdp_optimizer"](
            fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index,
            adapter_only, use_dcp,
        )  # fmt: skip
    plain = _plain_optimizer(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, plain, options=_SHARDED)}
    _load(accelerator, path, state)
    set_optimizer_state_dict(model, plain, state["optimizer"], options=_SHARDED)
    return None


_REPLACEMENTS: dict[str, Callable[..., Any]] = {
    "save_fsdp_model": save_fsdp_model,
    "load_fsdp_model": load_fsdp_model,
    "save_fsdp_optimizer": save_fsdp_optimizer,
    "load_fsdp_optimizer": load_fsdp_optimizer,
}


def _install_fsdp_functions() -> None:
    """Put snapshard's FSDP functions where Accelerate's `save_state`/`load_state` look them
    up (the names `accelerate.accelerator` imported), once per process."""
    import accelerate.accelerator as module

    for name in _NAMES:
        current = getattr(module, name)
        if current is not _REPLACEMENTS[name]:
            _ORIGINALS[name] = current
            setattr(module, name, _REPLACEMENTS[name])


def fsdp_functions() -> dict[str, Callable[..., Any]]:
    """The four FSDP functions `use_snapshard` installs, by name (as Accelerate calls them)."""
    _install_fsdp_functions()
    return dict(_REPLACEMENTS)


def use_snapshard(
    accelerator: Any,
    options: SaveOptions = SaveOptions(),
    read_options: ReadOptions = ReadOptions(),
) -> tuple[Any, Any]:
    """Register both hooks on `accelerator`, and switch its FSDP sharded checkpoints to
    snapshard; returns the hooks' handles (`.remove()` undoes the hooks; `stop_using`
    the FSDP switch)."""
    _SWITCHED[accelerator] = _Switch(options, read_options)
    _install_fsdp_functions()
    return (
        accelerator.register_save_state_pre_hook(save_hook(options)),
        accelerator.register_load_state_pre_hook(load_hook(read_options)),
    )


def stop_using(accelerator: Any) -> None:
    """Give `accelerator`'s FSDP checkpoints back to Accelerate's own functions."""
    _SWITCHED.pop(accelerator, None)


__all__ = [
    "NAME",
    "fsdp_functions",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "load_hook",
    "save_fsdp_model",
    "save_fsdp_optimizer",
    "save_hook",
    "stop_using",
    "use_snapshard",
]
