"""snapshard for Hugging Face Accelerate: `accelerator.save_state(dir)` / `load_state(dir)`
store the models' weights as one snapshard checkpoint, `dir/snapshard_models`.

    handles = snapshard.accelerate.use_snapshard(accelerator)   # once, after creating it

The switch goes through Accelerate's own seams, `register_save_state_pre_hook` and
`register_load_state_pre_hook`: the save hook writes the state dicts Accelerate is about to
write and takes them out of its list (so no `model.safetensors` is written); the load hook
fills the models in place and takes them out of its list. Accelerate passes its hooks the
models only: optimizers, schedulers, samplers, the RNG states and custom objects are still
written by Accelerate itself (`optimizer.bin` and the rest, with torch.save). Needs the
`accelerate` extra. See docs/integrations.md.
"""

from __future__ import annotations

import os
from typing import Any

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


def use_snapshard(
    accelerator: Any,
    options: SaveOptions = SaveOptions(),
    read_options: ReadOptions = ReadOptions(),
) -> tuple[Any, Any]:
    """Register both hooks on `accelerator`; returns their handles (`.remove()` undoes it)."""
    return (
        accelerator.register_save_state_pre_hook(save_hook(options)),
        accelerator.register_load_state_pre_hook(load_hook(read_options)),
    )


__all__ = ["NAME", "load_hook", "save_hook", "use_snapshard"]
