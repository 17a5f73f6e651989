"""Per-rank values (snapshard.PerProcess) in torch state: tensors become host arrays when a
save takes them, and tensors again when a load gives each rank its own back.

A per-rank value is stored in the rank's own values file (see snapshard.per_process), as
JSON: a tensor goes there as its bytes, dtype and shape. They are meant for small state that
differs between ranks by design, `torch.get_rng_state()`, a data loader's position; sharded
state belongs in DTensors.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch

from ..errors import TargetMismatchError, UnsupportedLeafError
from .dtypes import from_numpy, host_view, numpy_dtype


def is_dtensor(x: Any) -> bool:
    # A DTensor exists only once its module is imported, and importing it costs ~0.5 s: a
    # state dict of plain tensors does not pay it.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(x, dtensor)


def local_tensor(value: Any) -> torch.Tensor:
    """A DTensor's local shard. Its `_local_tensor` where it has one: `to_local()` goes
    through an autograd function, a few microseconds a call, which a state of 100,000
    leaves pays several times per save and restore; the shard is only read, or filled in
    place, here, so the autograd view it makes is not needed."""
    local = getattr(value, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else value.to_local()


def refuse_meta(value: torch.Tensor, leaf: str) -> None:
    """A tensor on the meta device has a shape and no data: nothing to save."""
    meta = value.is_meta or (is_dtensor(value) and local_tensor(value).is_meta)
    if meta:
        raise UnsupportedLeafError(
            f"leaf {leaf!r}: the tensor is on the meta device (a shape without data), so "
            "there is nothing to save; materialise it first (model.to_empty(device=...), then "
            "initialise or load it)"
        )


def unstorable(t: torch.Tensor, target: bool = False) -> str | None:
    """Why the bytes of tensor `t` (a DTensor's local tensor) are not its values in
    row-major order, so that it can be neither saved nor loaded into as it is (None: they
    are). `target`: it is to be written, where elements sharing memory would be lost."""
    if t.layout is not torch.strided:
        return f"a {t.layout} tensor (save or load its .to_dense())"
    if t.is_conj() or t.is_neg():
        return "a conjugate or negative view (call .resolve_conj() or .resolve_neg() first)"
    if target and any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True)):
        return "an expanded tensor, whose elements share memory (load into a tensor of its own)"
    return None


def host_values(value: Any, leaf: str) -> Any:
    """`value` with every tensor in it copied to a NumPy array (the save stores those)."""
    if isinstance(value, torch.Tensor):
        if is_dtensor(value):
            raise UnsupportedLeafError(
                f"leaf {leaf!r}: a DTensor in snapshard.PerProcess; a DTensor is saved as a "
                "leaf of its own (each rank writes its shards), unwrap it"
            )
        refuse_meta(value, leaf)
        numpy_dtype(value.dtype, leaf=leaf)
        t = value.detach()
        return host_view(t if t.device.type == "cpu" else t.cpu()).copy()
    if isinstance(value, dict):
        return {k: host_values(v, leaf) for k, v in value.items()}
    if isinstance(value, list | tuple):  # (a namedtuple is stored as a tuple)
        items = [host_values(v, leaf) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def as_tensors(value: Any) -> Any:
    """A restored value with its arrays as CPU tensors (NumPy where torch lacks the dtype)."""
    if isinstance(value, np.ndarray):
        t = from_numpy(np.array(value))  # (a writable copy: decoded values are read-only)
        return value if t is None else t
    if isinstance(value, dict):
        return {k: as_tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [as_tensors(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def into_target(value: Any, target: Any, where: str) -> Any:
    """This rank's restored value for a target leaf: copied into the target's tensor (in
    place; its shape must match, its dtype is cast to) where the target holds one, else
    `as_tensors` of it."""
    if target is None or not isinstance(target, torch.Tensor):
        return as_tensors(value)
    if not isinstance(value, np.ndarray):
        raise TargetMismatchError(
            f"{where}: the target has a tensor, this rank's saved value is a {type(value).__name__}"
        )
    if tuple(target.shape) != value.shape:
        raise TargetMismatchError(
            f"{where}: this rank's saved tensor has shape {value.shape}, the target {tuple(target.shape)}"
        )
    saved = as_tensors(value)
    if not isinstance(saved, torch.Tensor):  # a dtype torch lacks: cast on the host
        saved = torch.from_numpy(np.asarray(value, dtype=numpy_dtype(target.dtype)))
    with torch.no_grad():
        target.copy_(saved)
    return target
