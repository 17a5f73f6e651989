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

A state directory is whole or refused. Accelerate writes its parts one by one into the
directory itself (weights, then optimizers, schedulers, samplers, RNG states, custom
objects), so a `save_state` killed half-way leaves a directory with some of them. Before
snapshard writes the first byte of a save into it, every process puts its marker there,
`snapshard_incomplete_<process index>`; they are taken away once every process's
`save_state` has returned, its part written (`use_snapshard` wraps the accelerator's
`save_state` for that: one barrier per save). A
directory with a marker left is refused by `load_state` before any model or optimizer is
touched, with an error naming the newest complete directory beside it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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
from .errors import CheckpointNotFoundError
from .options import ReadOptions, SaveOptions

NAME = "snapshard_models"
INCOMPLETE = "snapshard_incomplete_"
_INCOMPLETE = re.compile(rf"^{INCOMPLETE}(\d+)$")
# Accelerate's automatic checkpoint naming (ProjectConfiguration): project_dir/checkpoints/
_AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")
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
        _mark_incomplete(output_dir)
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
    _mark_incomplete(output_dir)
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
    _mark_incomplete(output_dir)
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
    _wrap_save_state(accelerator)
    _check_launch(accelerator)
    return (
        accelerator.register_save_state_pre_hook(save_hook(options)),
        accelerator.register_load_state_pre_hook(load_hook(read_options)),
    )


def stop_using(accelerator: Any) -> None:
    """Give `accelerator`'s FSDP checkpoints back to Accelerate's own functions."""
    _SWITCHED.pop(accelerator, None)


# ---- whole state directories or refused ones ---------------------------------------------
# The directories the running save_state of this process has marked; None outside one (a
# hook registered by hand, without use_snapshard's wrapper, marks nothing: nothing would
# take its marker away).
_marked: set[str] | None = None


def _marker(directory: str, index: int) -> Path:
    return Path(directory) / f"{INCOMPLETE}{index}"


def _mark_incomplete(output_dir: str) -> None:
    """Before this process writes the first byte of a save_state into `output_dir`: its
    marker there (once per save)."""
    if _marked is None or output_dir in _marked:
        return
    from accelerate.state import PartialState

    os.makedirs(output_dir, exist_ok=True)
    _marker(output_dir, PartialState().process_index).write_text(
        "save_state of this directory started; this process's part is not all written yet\n"
    )
    _marked.add(output_dir)


def _markers(directory: str) -> list[tuple[int, Path]]:
    """(process index, path) of each marker in `directory`."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(m, n) for n in names if (m := _INCOMPLETE.match(n))]
    return sorted((int(m.group(1)), Path(directory) / n) for m, n in found)


def _wrap_save_state(accelerator: Any) -> None:
    """Make `accelerator.save_state` take the markers away once every process's returned
    (one barrier: then every part is written, and every process, the next to load
    included, finds none); a save_state that raises leaves them. Once per accelerator.
    Every marker there goes, also those of process indices this job does not have (a
    killed save of a larger job): nothing else would remove them."""
    original = accelerator.save_state
    if getattr(original, "_snapshard_wrapped", False):
        return

    @functools.wraps(original)
    def save_state(*args: Any, **kwargs: Any) -> Any:
        global _marked
        _marked = set()
        try:
            result = original(*args, **kwargs)
            if _marked:  # the same on every process: each ran the hook or FSDP functions
                from accelerate.state import PartialState

                PartialState().wait_for_everyone()
                for directory in _marked:
                    for _, path in _markers(directory):
                        path.unlink(missing_ok=True)
            return result
        finally:
            _marked = None

    save_state._snapshard_wrapped = True  # type: ignore[attr-defined]
    accelerator.save_state = save_state


def refuse_incomplete(input_dir: str) -> None:
    """Raise CheckpointNotFoundError if a save_state into `input_dir` did not finish (a
    process's marker is there), before anything is loaded; naming the newest complete
    directory beside it where Accelerate's automatic naming shows one."""
    left = _markers(input_dir)
    if not left:
        return
    indices = ", ".join(str(i) for i, _ in left)
    message = (
        f"{input_dir}: this Accelerate state directory is incomplete: its save_state "
        f"stopped before process(es) {indices} had written their part (their "
        f"{INCOMPLETE}<index> markers are there); nothing was loaded, the models and "
        "optimizers are unchanged"
    )
    earlier = _newest_complete_before(input_dir)
    if earlier is not None:
        message += (
            f". The newest complete one beside it is {earlier}: "
            f"accelerator.load_state({str(earlier)!r}); load_state() without a directory "
            f"picks the newest folder, so remove {input_dir} (Accelerate's save_state "
            "also refuses to save into it again)"
        )
    else:
        message += f". Load another state directory, or save into {input_dir} again"
    raise CheckpointNotFoundError(message)


def _newest_complete_before(input_dir: str) -> Path | None:
    """Of the `checkpoint_<n>` folders beside `input_dir` (Accelerate's automatic naming),
    the newest one older than it without markers; None when it is not one of them."""
    path = Path(os.path.abspath(input_dir))
    own = _AUTOMATIC.match(path.name)
    if own is None:
        return None
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return None
    older = []
    for entry in entries:
        m = _AUTOMATIC.match(entry.name)
        if m and int(m.group(1)) < int(own.group(1)) and entry.is_dir():
            older.append((int(m.group(1)), Path(entry.path)))
    for _, candidate in sorted(older, reverse=True):
        if not _markers(str(candidate)):
            return candidate
    return None


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


__all__ = [
    "INCOMPLETE",
    "NAME",
    "fsdp_functions",
    "load_fsdp_model",
    "load_fsdp_optimizer",
    "load_hook",
    "refuse_incomplete",
    "save_fsdp_model",
    "save_fsdp_optimizer",
    "save_hook",
    "stop_using",
    "use_snapshard",
]
