"""Bounds checked before a reader allocates or reads anything a manifest implies."""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

MAX_DIM = 1 << 48
MAX_BYTES = 1 << 56
MAX_NDIM = 64
MAX_DEPTH = 256
MAX_PROCESSES = 1 << 20
MAX_FILES_PER_PROCESS = 4096


def bounded_int(x: Any, lo: int, hi: int, what: str, where: str) -> int:
    """`x` if it is an int in [lo, hi], else a CorruptCheckpointError naming `what`."""
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise CorruptCheckpointError(f"{where}: malformed {what} {str(x)[:100]}")
    return x
