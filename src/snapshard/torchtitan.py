"""A torchtitan checkpoint manager that writes snapshard checkpoints.

Select it in torchtitan's config (``Trainer.Config(checkpoint=CheckpointManager.Config(...))``):
the trainer builds it, calls ``save(step, last_step)`` after every step,
``maybe_wait_for_staging()`` before ``optimizers.step()`` and ``load(step)`` at start-up, as
it does its own DCP manager. Every step is one snapshard checkpoint under ``<dump
folder>/<folder>/<step>``, saved asynchronously through ``snapshard.torch.CheckpointManager``:
``save`` returns once every byte this rank writes is on the host, so the optimizer may step
at once. See docs/integrations.md, "torchtitan".

A manager with ``load_only=True`` (an evaluation job beside training on the same folder) is a
read-only snapshard manager: it lists and loads, and never takes the folder's writer lease,
which a training manager takes at its first save.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)

import snapshard
import snapshard.torch as sst
from snapshard.errors import TargetMismatchError
from snapshard.format.reading import read_manifest
from snapshard.storage import storage_for
from snapshard.torch.dtypes import from_numpy, host_view

_EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_BYTES = "__snapshard_bytes__"


def _encode(value: Any) -> Any:
    """A per-rank state dict as PerProcess can hold it: bytes (torchtitan's data loaders
    pickle their state) become uint8 arrays, marked so that `_decode` gives them back."""
    if isinstance(value, bytes):
        return {_BYTES: np.frombuffer(value, dtype=np.uint8).copy()}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v) for v in value)
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_BYTES}:
            return np.asarray(value[_BYTES], dtype=np.uint8).tobytes()
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v) for v in value)
    return value


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    t = from_numpy(np.ascontiguousarray(a))
    if t is None:
        raise TypeError(f"torch has no dtype for {a.dtype}")
    return t


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager on snapshard (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        async_save: bool = True
        """Return from a save once this rank's bytes are on the host; write in the
        background (False: wait for the commit)."""
        trees_differ: bool | None = None
        """Whether the ranks' states hold different keys (pipeline parallelism: each rank
        its own stages), saved as their union (snapshard.SaveOptions.trees_differ). None: when
        the model parts show it (several parts on a rank, or parameters on a mesh with a
        "pp" dimension); set True for pipeline stages of plain tensors."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future[None] | None = None
        self.config = config
        self.folder = os.path.join(base_folder, config.folder) if base_folder else config.folder
        self.states = states
        self.states.update(
            {
                MODEL: ModelWrapper(model_parts),
                OPTIMIZER: optimizers,
                DATALOADER: dataloader,
                LR_SCHEDULER: lr_schedulers,
            }
        )
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf is True, but sd_adapter is not provided")
        if config.initial_load_in_hf and config.initial_load_path and sd_adapter is None:
            raise ValueError(
                "checkpoint.initial_load_in_hf is True, but sd_adapter is not provided"
            )
        if config.initial_load_in_hf_quantized:
            raise ValueError("checkpoint.initial_load_in_hf_quantized is not supported here")
        if config.create_seed_checkpoint:
            raise ValueError(
                "checkpoint.create_seed_checkpoint is not supported here: start from "
                "initial_load_path (a DCP, snapshard or Hugging Face checkpoint) instead"
            )
        unknown = set(config.exclude_from_loading) - set(self.states)
        if unknown:
            raise ValueError(
                f"checkpoint.exclude_from_loading names {sorted(unknown)}, which are not "
                f"checkpointed states (these are: {sorted(self.states)})"
            )
        self._manager = sst.CheckpointManager(
            self.folder,
            save_interval_steps=1,  # when to save is decided here, with torchtitan's rules
            max_to_keep=config.keep_latest_k or None,
            read_only=config.load_only,  # an evaluation job: no writer lease, no deletions
            async_save=config.async_save,
            save_options=snapshard.SaveOptions(
                trees_differ=pipelined(model_parts)
                if config.trees_differ is None
                else config.trees_differ
            ),
        )

    def __del__(self) -> None:
        self.close()

    # --- state -------------------------------------------------------------------

    def _state(self, keys: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in keys:
            obj = self.states.get(key)
            if obj is None:
                continue
            sd = obj.state_dict()
            # A data loader's state is per rank by design (it is keyed by rank).
            out[key] = snapshard.PerProcess(_encode(sd)) if key == DATALOADER else sd
        return out

    def _target(self, keys: list[str]) -> dict[str, Any]:
        out = self._state(keys)
        if DATALOADER in out:
            out[DATALOADER] = None
        return out

    def _apply(self, loaded: dict[str, Any]) -> None:
        for key, sd in loaded.items():
            self.states[key].load_state_dict(_decode(sd) if key == DATALOADER else sd)

    def _model_state(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        sd = self.states[MODEL].state_dict()
        if dtype is None:
            return dict(sd)
        return {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in sd.items()}

    # --- BaseCheckpointManager ----------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if last_step and self.config.last_save_model_only:
            dtype = _EXPORT_DTYPES[self.config.export_dtype]
            if self.config.last_save_in_hf:
                self._manager.wait_until_finished()
                self._export_hf(curr_step, dtype)
                return True
            self._manager.save(curr_step, {MODEL: self._model_state(dtype)}, force=True)
            self._manager.wait_until_finished()
            return True
        keys = list(self.states)
        self._manager.save(curr_step, self._state(keys), force=True)
        if last_step:
            self._manager.wait_until_finished()
        elif self.config.async_save:
            # The base class's maybe_wait_for_saving() waits (through _wait_for_saving)
            # only while save_future is set; the manager holds the save itself.
            self.save_future = Future[None]()
        return True

    def _export_hf(self, step: int, dtype: torch.dtype) -> None:
        import snapshard.safetensors as sts

        full = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).to(dtype)
            for k, v in self._model_state().items()
        }
        hf = self.sd_adapter.to_hf(full)
        path = os.path.join(self.folder, f"step-{step}-hf")
        sts.save(
            path,
            {name: host_view(t.cpu().contiguous()) for name, t in hf.items()},
            metadata={"format": "pt"},
            coordinator=sst.default_coordinator(),
            overwrite=True,
        )

    def _maybe_wait_for_staging(self) -> None:
        # `save` returned after the blocking phase: this rank's bytes are already on the host.
        return None

    def _wait_for_saving(self) -> None:
        self._manager.wait_until_finished()
        self.save_future = None

    def _close(self) -> None:
        if hasattr(self, "_manager"):
            self._manager.close()
            del self._manager

    def _load(self, step: int = -1) -> bool:
        steps = self._manager.all_steps()
        if step == -1:
            if not steps:
                return self._initial_load()
            step = max(steps)
        elif step not in steps:
            raise FileNotFoundError(
                f"no checkpoint of step {step} in {self.folder} (steps there: {steps})"
            )
        path = os.path.join(self.folder, str(step))
        saved = set(sst.metadata(path))
        keys = [k for k in self.states if k in saved and k not in self.config.exclude_from_loading]
        try:
            loaded = self._manager.restore(step, self._target(keys))
        except TargetMismatchError as e:
            if DATALOADER in keys:
                _check_world_size(path, e)
            raise
        self._apply(loaded)
        return True

    def _initial_load(self) -> bool:
        path = self.config.initial_load_path
        if not path:
            return False
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint.initial_load_path {path} does not exist")
        if self.config.initial_load_in_hf:
            import snapshard.safetensors as sts

            arrays = sts.load(path)
            sd = self.sd_adapter.from_hf({k: _from_numpy(a) for k, a in arrays.items()})
            opts = StateDictOptions(full_state_dict=True, strict=False)
            for part in self.states[MODEL].model:
                set_model_state_dict(part, {k: v for k, v in sd.items()}, options=opts)
            self.states[MODEL].load_state_dict(self.states[MODEL].state_dict())
            return True
        model_only = self.config.initial_load_model_only
        keys = (
            [MODEL]
            if model_only
            else [k for k in self.states if k not in self.config.exclude_from_loading]
        )
        if os.path.exists(os.path.join(path, "manifest.json")):  # a snapshard checkpoint
            self._apply(sst.load(path, self._target(keys)))
            return True
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise ValueError(
                f"checkpoint.initial_load_path {path} is neither a snapshard checkpoint "
                "(manifest.json) nor a DCP checkpoint (.metadata)"
            )
        import torch.distributed.checkpoint as dcp

        # torchtitan's own checkpoints keep the model's entries at the top level.
        state: dict[str, Any] = dict(self.states[MODEL].state_dict())
        for key in keys:
            if key != MODEL and self.states.get(key) is not None:
                state[key] = self.states[key].state_dict()
        dcp.load(state, checkpoint_id=path)
        self.states[MODEL].load_state_dict(state)
        for key in keys:
            if key != MODEL and key in state:
                self.states[key].load_state_dict(state[key])
        return True


def pipelined(model_parts: list[nn.Module]) -> bool:
    """Whether the model parts are pipeline stages, whose keys differ by rank: several on
    this rank, or parameters on a mesh whose root has a "pp" dimension (torchtitan's name).
    (Every rank decides alike: every rank holds some stage.)"""
    if len(model_parts) > 1:
        return True
    for part in model_parts:
        for p in part.parameters():
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
                return "pp" in (root.mesh_dim_names or ())
    return False


def _check_world_size(path: str, error: TargetMismatchError) -> None:
    """Raise torchtitan's advice, caused by `error`, when the checkpoint at `path` was saved
    by another number of ranks: the data loader's state is one value per rank and cannot
    follow a world-size change, and what a torchtitan user can do about it is to leave it
    out (the core's advice, a `resplit` function, is an argument torchtitan cannot pass)."""
    with storage_for(path) as storage:
        saved = read_manifest(storage).process_count
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if saved == world:
        return
    raise TargetMismatchError(
        f"{path}: the {DATALOADER!r} state was saved per rank by {saved} rank(s), and this "
        f"job has {world}: a data loader's position cannot follow a change of world size. "
        f'Set checkpoint.exclude_from_loading = ["{DATALOADER}"] (on the command line: '
        f"--checkpoint.exclude_from_loading {DATALOADER}) to load the model, the optimizer "
        f"and the rest, with the data loader starting afresh"
    ) from error


__all__ = ["CheckpointManager"]
