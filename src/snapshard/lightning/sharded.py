"""Lightning's sharded checkpoints (FSDP2 and tensor parallelism through
`ModelParallelStrategy`, FSDP through `FSDPStrategy`) as one snapshard checkpoint, written
and read through DCP with snapshard's storage: its entries, `save_sharded` /
`load_sharded`, and the two strategies that call them."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
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

from .. import torch as sst
from ..options import ReadOptions, SaveOptions
from ..storage.atomic_rename import move_into_place
from .migration import lightning_layout, save_target
from .pickled import torch_load_dict

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
    return unpickle_rest(path, state[OTHER], trust_pickle, weights_only, "the strategy")


def unpickle_rest(
    path: str, data: torch.Tensor, trust_pickle: bool, weights_only: bool | None, owner: str
) -> dict[str, Any]:
    """The rest of Lightning's dict from its `torch.save` bytes (the `lightning` entry of a
    sharded checkpoint), read as `torch_load_dict` reads it."""
    what = f"Lightning's entries ({OTHER!r})"
    source = io.BytesIO(data.numpy().tobytes())
    return torch_load_dict(source, path, what, None, trust_pickle, weights_only, owner)


def sharded_layout(saved: Any) -> bool:
    """The metadata tree of a checkpoint `save_sharded` wrote (not the CheckpointIO's dict)."""
    return (
        isinstance(saved, dict) and MODEL in saved and OTHER in saved and "state_dict" not in saved
    )


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
        target = str(strategy.broadcast(save_target(path)))
        save_sharded(target, checkpoint, strategy.global_rank, self.snapshard_options)
        if target != path:
            if strategy.global_rank == 0:
                move_into_place(Path(target), Path(path), replace=True)
            strategy.barrier()
        return None

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        strategy: Any = self
        path = str(strategy.broadcast(str(checkpoint_path)))
        if lightning_layout(path):
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
