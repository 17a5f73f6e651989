"""FSDP's sharded state (`SHARDED_STATE_DICT`) through snapshard. It does not go through the
state hooks: Accelerate calls `save_fsdp_model` / `save_fsdp_optimizer` (and the loads),
which write with DCP's `FileSystemWriter`. `use_snapshard` replaces those four functions
where Accelerate looks them up (once per process), for the accelerators it was given only
(`stop_using` gives one back): theirs write each model and optimizer as a snapshard
checkpoint through DCP with snapshard's storage (same directory names); any other
accelerator, state-dict type or option goes to Accelerate's own functions.
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

from .. import torch as sst
from ..options import ReadOptions, SaveOptions
from .incomplete import mark_incomplete, refuse_incomplete


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


def _part_dir(directory: str, part: str, index: int) -> str:
    """Where Accelerate puts model (part "FSDP_MODEL_NAME") or optimizer ("OPTIMIZER_NAME")
    number `index` of a save_state."""
    from accelerate.utils import constants

    return os.path.join(directory, f"{getattr(constants, part)}_{index}")


def save_fsdp_model(
    fsdp_plugin: Any, accelerator: Any, model: Any, output_dir: str, model_index: int = 0,
    adapter_only: bool = False, use_dcp: bool = True,
) -> Any:  # fmt: skip
    """Accelerate's `save_fsdp_model`, through snapshard for a switched accelerator."""
    if not _ours(fsdp_plugin, accelerator, use_dcp, adapter_only):
        return _ORIGINALS["save_fsdp_model"](
            fsdp_plugin, accelerator, model, output_dir, model_index, adapter_only, use_dcp
        )
    mark_incomplete(output_dir)
    state = {"model": get_model_state_dict(model, options=_SHARDED)}
    _save(accelerator, _part_dir(output_dir, "FSDP_MODEL_NAME", model_index), state)
    return None


def load_fsdp_model(
    fsdp_plugin: Any, accelerator: Any, model: Any, input_dir: str, model_index: int = 0,
    adapter_only: bool = False, use_dcp: bool = True,
) -> Any:  # fmt: skip
    """Accelerate's `load_fsdp_model`, through snapshard for a switched accelerator and a
    snapshard checkpoint (one Accelerate wrote itself goes to Accelerate's)."""
    refuse_incomplete(input_dir)
    path = _part_dir(input_dir, "FSDP_MODEL_NAME", model_index)
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
    mark_incomplete(output_dir)
    plain = _plain_optimizer(optimizer)
    state = {"optimizer": get_optimizer_state_dict(model, plain, options=_SHARDED)}
    _save(accelerator, _part_dir(output_dir, "OPTIMIZER_NAME", optimizer_index), state)
    return None


def load_fsdp_optimizer(
    fsdp_plugin: Any, accelerator: Any, optimizer: Any, model: Any, input_dir: str,
    optimizer_index: int = 0, adapter_only: bool = False, use_dcp: bool = True,
) -> None:  # fmt: skip
    """Accelerate's `load_fsdp_optimizer`, through snapshard as `load_fsdp_model` is."""
    path = _part_dir(input_dir, "OPTIMIZER_NAME", optimizer_index)
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
    f.__name__: f
    for f in (save_fsdp_model, load_fsdp_model, save_fsdp_optimizer, load_fsdp_optimizer)
}


def _install_fsdp_functions() -> None:
    """Put snapshard's FSDP functions where Accelerate's `save_state`/`load_state` look them
    up (the names `accelerate.accelerator` imported), once per process."""
    import accelerate.accelerator as module

    for name, ours in _REPLACEMENTS.items():
        current = getattr(module, name)
        if current is not ours:
            _ORIGINALS[name] = current
            setattr(module, name, ours)


def fsdp_functions() -> dict[str, Callable[..., Any]]:
    """The four FSDP functions `use_snapshard` installs, by name (as Accelerate calls them)."""
    _install_fsdp_functions()
    return dict(_REPLACEMENTS)


def switch(accelerator: Any, options: SaveOptions, read_options: ReadOptions) -> None:
    """Send `accelerator`'s FSDP sharded checkpoints through snapshard."""
    _SWITCHED[accelerator] = _Switch(options, read_options)
    _install_fsdp_functions()


def stop_using(accelerator: Any) -> None:
    """Give `accelerator`'s FSDP checkpoints back to Accelerate's own functions."""
    _SWITCHED.pop(accelerator, None)
