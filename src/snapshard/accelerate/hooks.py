"""The models' weights through Accelerate's own seams, `register_save_state_pre_hook` and
`register_load_state_pre_hook`: the save hook writes the state dicts Accelerate is about to
write and takes them out of its list (so no `model.safetensors` is written); the load hook
fills the models in place and takes them out of its list. Accelerate passes its hooks the
models only: optimizers, schedulers, samplers, the RNG states and custom objects are still
written by Accelerate itself (`optimizer.bin` and the rest, with torch.save).
`use_snapshard` registers both and switches the rest (fsdp.py, incomplete.py).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .. import torch as sst
from ..options import ReadOptions, SaveOptions
from .fsdp import switch
from .incomplete import mark_incomplete, refuse_incomplete, wrap_save_state

NAME = "snapshard_models"
log = logging.getLogger("snapshard")


def _key(i: int) -> str:
    return f"model_{i}"


def save_hook(options: SaveOptions = SaveOptions()) -> Any:
    """The hook for `Accelerator.register_save_state_pre_hook`: the models' state dicts
    Accelerate gathered go to `output_dir/snapshard_models` (every process calls it, as
    snapshard.torch.save wants); the list is emptied so Accelerate writes no weights."""

    def hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if not weights:
            return
        mark_incomplete(output_dir)
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
        refuse_incomplete(input_dir)
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
    """Register both hooks on `accelerator`, and switch its FSDP sharded checkpoints to
    snapshard; returns the hooks' handles (`.remove()` undoes the hooks; `stop_using`
    the FSDP switch)."""
    switch(accelerator, options, read_options)
    wrap_save_state(accelerator)
    _check_launch(accelerator)
    return (
        accelerator.register_save_state_pre_hook(save_hook(options)),
        accelerator.register_load_state_pre_hook(load_hook(read_options)),
    )


def _check_launch(accelerator: Any) -> None:
    """Warn when `accelerate launch --cpu --num_processes N` (N > 1) started this process
    alone: Accelerate's --cpu launcher runs one process whatever N is. It sets
    ACCELERATE_USE_CPU with MASTER_ADDR/MASTER_PORT (for N > 1) but no WORLD_SIZE."""
    env = os.environ
    asked = env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if not (asked and "MASTER_PORT" in env and "WORLD_SIZE" not in env):
        return
    if accelerator.num_processes != 1:
        return
    log.warning(
        "snapshard.accelerate: this job runs ONE process although it was launched for "
        "several (`accelerate launch --cpu --num_processes N` starts one process whatever "
        "N is). For several CPU processes (gloo) use `accelerate launch --multi_gpu "
        "--num_processes N script.py` on a machine without GPUs, or `torchrun "
        "--nproc-per-node N script.py`"
    )
