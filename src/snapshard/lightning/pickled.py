"""Lightning's checkpoint dict as snapshard leaves. Tensors, NumPy arrays and plain values
(`int`, `float`, `bool`, `str`, `None`) in dicts, lists and tuples are stored as snapshard
stores them (no pickle). Any other object (a dict subclass such as hyper-parameters'
`AttributeDict`, a callback's custom object) is pickled into an opaque `uint8` leaf; loading
such a checkpoint needs `CheckpointIO(trust_pickle=True)`, and is refused otherwise, naming
the entries.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from typing import IO, Any

import numpy as np
import torch

# A pickled object is stored as a dict holding only this key, its bytes a uint8 array.
PICKLED = "__snapshard_pickled__"
_PLAIN = (int, float, bool, str, type(None))


class UntrustedPickleError(ValueError):
    """A checkpoint holds pickled objects and the CheckpointIO was not told to trust it."""


def encode(value: Any, path: str) -> Any:
    """Lightning's checkpoint dict as snapshard leaves and values, other objects pickled."""
    if isinstance(value, (torch.Tensor, np.ndarray)) or type(value) in _PLAIN:
        return value
    if type(value) in (dict, OrderedDict):
        if PICKLED in value:
            raise ValueError(f"checkpoint entry {path or '/'} uses the reserved key {PICKLED!r}")
        return {k: encode(v, f"{path}/{k}") for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(encode(v, f"{path}/{i}") for i, v in enumerate(value))
    return {PICKLED: np.frombuffer(pickle.dumps(value), dtype=np.uint8).copy()}


def _pickled_paths(value: Any, path: str = "") -> list[str]:
    if isinstance(value, dict):
        if set(value) == {PICKLED}:
            return [path or "/"]
        return [p for k, v in value.items() for p in _pickled_paths(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _pickled_paths(v, f"{path}/{i}")]
    return []


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {PICKLED}:
            data = value[PICKLED]
            data = data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
            return pickle.loads(data.astype(np.uint8).tobytes())
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(decode(v) for v in value)
    return value


def refuse_untrusted(
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


def torch_load_dict(
    source: IO[bytes],
    path: str,
    what: str,
    map_location: Any,
    trust_pickle: bool,
    weights_only: bool | None,
    owner: str,
) -> dict[str, Any]:
    """Lightning's dict from `torch.save` bytes (`what` of `path`), read with torch.load's
    weights_only unpickler (tensors, containers, plain values and the types Lightning
    registers as safe) unless `trust_pickle` is set; `weights_only=True` keeps it even then.
    `owner` is what takes `trust_pickle`."""
    restricted = bool(weights_only) or not trust_pickle
    try:
        loaded = torch.load(source, map_location=map_location, weights_only=restricted)
    except pickle.UnpicklingError as e:
        lines = str(e).splitlines()
        named = [
            line for line in lines if "Unsupported global" in line or "Unpickler error" in line
        ]
        reason = (named or lines or [type(e).__name__])[0].strip()
        raise UntrustedPickleError(
            f"{path}: {what} holds objects torch.load's weights_only unpickler refuses "
            f"({reason}); pass trust_pickle=True to {owner} for a checkpoint from a source "
            "you trust"
        ) from e
    if not isinstance(loaded, dict):
        raise ValueError(
            f"{path}: {what} is not Lightning's checkpoint dict (torch.load gave a "
            f"{type(loaded).__name__})"
        )
    return loaded
