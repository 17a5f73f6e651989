"""Values each process has its own of (a data-iterator position, a host's RNG state).

Leaves that are not jax.Arrays are assumed identical on every process, and a save checks
that they are. A value that differs by design is wrapped in `PerProcess`: every process
stores its own, in its own small file (`index/p<process>-<nonce>.values.json`), and a
restore gives each process back its own. On another process count the restore refuses,
naming the leaf, unless `load(..., resplit=fn)` says how to re-split the saved values.

A value is a Python value (None, bool, int, float, str, bytes), a NumPy array or scalar, or
dicts (str keys) and lists of those, encoded as JSON without pickle; in snapshard.torch also
tensors (stored as their host bytes, restored as tensors). It is checked when the save
starts, where the message can name its leaf.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from .dtypes import dtype_from_name, dtype_name
from .errors import CorruptCheckpointError, UnsupportedLeafError
from .format.values import decode_value, encode_value

# resplit(leaf name, the saved values by process, this process, process count) -> value
Resplit = Callable[[str, list[Any], int, int], Any]


class PerProcess:
    """Wraps a value that each process saves and restores for itself (checked by the save
    that takes it, naming its leaf)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"PerProcess({self.value!r})"


def checked(value: Any, leaf: str) -> Any:
    """`value`, once it is known to be storable as the per-process value of `leaf`: a save
    refuses it in its blocking phase, naming the leaf, not when the background writes it."""
    encode(value, leaf)
    return value


def encode(v: Any, where: str) -> dict[str, Any]:
    if isinstance(v, np.ndarray | np.generic):
        a = np.ascontiguousarray(v)
        return {
            "type": "ndarray" if isinstance(v, np.ndarray) else "npscalar",
            "dtype": dtype_name(a.dtype, leaf=where),
            "shape": list(a.shape),
            "data": base64.b64encode(a.astype(a.dtype.newbyteorder("<")).tobytes()).decode(),
        }
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise UnsupportedLeafError(f"leaf {where!r}: per-process dicts need str keys")
        return {"type": "dict", "items": {k: encode(x, where) for k, x in v.items()}}
    if isinstance(v, list | tuple):
        return {
            "type": "list" if isinstance(v, list) else "tuple",
            "items": [encode(x, where) for x in v],
        }
    if v is None or isinstance(v, bool | int | float | str | bytes):
        return encode_value(v, where)
    raise UnsupportedLeafError(
        f"leaf {where!r}: a per-process value of type {type(v).__module__}.{type(v).__qualname__} "
        "cannot be saved; per-process values are None, bool, int, float, str, bytes, NumPy "
        "arrays, and dicts (str keys), lists and tuples of them (tensors with snapshard.torch)"
    )


def decode(d: Any, where: str, depth: int = 0) -> Any:
    if depth > 64 or not isinstance(d, dict):
        raise CorruptCheckpointError(f"{where}: malformed per-process value")
    t = d.get("type")
    try:
        if t in ("ndarray", "npscalar"):
            dt = dtype_from_name(d["dtype"])
            shape = tuple(int(s) for s in d["shape"])
            raw = base64.b64decode(d["data"], validate=True)
            a = np.frombuffer(raw, dt.newbyteorder("<")).astype(dt).reshape(shape)
            return a[()] if t == "npscalar" else a
        if t == "dict":
            return {str(k): decode(x, where, depth + 1) for k, x in d["items"].items()}
        if t in ("list", "tuple"):
            items = [decode(x, where, depth + 1) for x in d["items"]]
            return items if t == "list" else tuple(items)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: malformed per-process value ({e})") from None
    return decode_value(d, where)


def encode_file(values: dict[int, Any], names: dict[int, str]) -> bytes:
    """This process's per-process values, by leaf number."""
    doc = {"leaves": {str(i): encode(v, names[i]) for i, v in values.items()}}
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_file(data: bytes, where: str) -> dict[int, Any]:
    try:
        doc = json.loads(data)
        return {int(k): v for k, v in doc["leaves"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: malformed per-process values ({e})") from None
