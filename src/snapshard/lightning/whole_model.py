"""Any checkpoint snapshard.lightning reads, as Lightning's dict with the model's whole
tensors, in one process: `load_from_checkpoint(cls, path)` is
`LightningModule.load_from_checkpoint` for snapshard checkpoints (and Lightning's files);
`to_lightning_file(path, out)` writes a snapshard checkpoint back as a Lightning file, the
way back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from lightning.pytorch import LightningModule

from .. import torch as sst
from ..dtypes import dtype_from_name
from ..errors import CheckpointNotFoundError
from ..inspection import ArrayMetadata, ValueMetadata
from ..options import ReadOptions
from ..storage.atomic_rename import fsync_dir
from ..storage.stale_staging import STAGING_SUFFIX
from ..torch.dtypes import torch_dtype
from .checkpoint_io import CheckpointIO, mapped
from .sharded import MODEL, OTHER, sharded_layout, unpickle_rest


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
    if not sharded_layout(saved):
        return whole.load_checkpoint(path, map_location, weights_only)
    target = {
        MODEL: _empty_like(saved[MODEL], path, MODEL),
        OTHER: torch.empty(saved[OTHER].shape, dtype=torch.uint8),
    }
    got = sst.load(path, target, read_options)
    checkpoint = unpickle_rest(path, got[OTHER], trust_pickle, weights_only, owner)
    checkpoint["state_dict"] = mapped(got[MODEL], map_location)
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
