"""Python values stored in a manifest (or a per-process values file) as typed JSON."""

from __future__ import annotations

import base64
from typing import Any

from ..errors import CorruptCheckpointError


def encode_value(v: Any, where: str) -> dict[str, Any]:
    if v is None:
        return {"type": "none"}
    if isinstance(v, bool):
        return {"type": "bool", "value": v}
    if isinstance(v, int):
        return {"type": "int", "value": str(v)}
    if isinstance(v, float):
        return {"type": "float", "value": v.hex()}
    if isinstance(v, str):
        return {"type": "str", "value": v}
    if isinstance(v, bytes):
        return {"type": "bytes", "value": base64.b64encode(v).decode()}
    raise CorruptCheckpointError(f"{where}: cannot encode value {v!r}")


_MAX_INT_DIGITS = 4300  # Python's own limit for int('...')


def decode_value(d: Any, where: str) -> Any:
    try:
        t = d["type"]
        if t == "none":
            return None
        if t == "bool" and isinstance(d["value"], bool):
            return d["value"]
        if t == "int" and isinstance(d["value"], str) and len(d["value"]) <= _MAX_INT_DIGITS:
            return int(d["value"])
        if t == "float" and isinstance(d["value"], str):
            return float.fromhex(d["value"])
        if t == "str" and isinstance(d["value"], str):
            return d["value"]
        if t == "bytes" and isinstance(d["value"], str):
            return base64.b64decode(d["value"], validate=True)
    except (KeyError, TypeError, ValueError):
        pass
    raise CorruptCheckpointError(f"{where}: malformed value entry {str(d)[:200]}")
