"""torch dtypes as the NumPy (and ml_dtypes) dtypes snapshard stores, and host views.

A CPU tensor becomes a NumPy array sharing its memory: directly for the dtypes NumPy has,
and through an unsigned integer view of the same width for bfloat16 and the float8 types
(NumPy then reinterprets the bytes as the ml_dtypes type). Nothing is copied.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from ..errors import UnsupportedLeafError

_NATIVE: dict[torch.dtype, np.dtype] = {
    torch.bool: np.dtype(np.bool_),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint16: np.dtype(np.uint16),
    torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
_VIEWED: dict[torch.dtype, np.dtype] = {
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.float8_e4m3fnuz: np.dtype(ml_dtypes.float8_e4m3fnuz),
    torch.float8_e5m2fnuz: np.dtype(ml_dtypes.float8_e5m2fnuz),
    torch.float8_e8m0fnu: np.dtype(ml_dtypes.float8_e8m0fnu),
}

TO_NUMPY: dict[torch.dtype, np.dtype] = {**_NATIVE, **_VIEWED}
FROM_NUMPY: dict[np.dtype, torch.dtype] = {v: k for k, v in TO_NUMPY.items()}
_UINT: dict[int, torch.dtype] = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


def numpy_dtype(dtype: torch.dtype, *, leaf: str = "?") -> np.dtype:
    try:
        return TO_NUMPY[dtype]
    except KeyError:
        raise UnsupportedLeafError(f"leaf {leaf!r}: torch dtype {dtype} cannot be stored") from None


def torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype of a stored NumPy dtype, None where torch has none (int4, ...)."""
    return FROM_NUMPY.get(np.dtype(dtype))


def host_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's memory (any strides), in the stored dtype."""
    t = t.detach()
    if t.dtype in _NATIVE:
        return t.numpy()
    np_dt = numpy_dtype(t.dtype)
    return t.view(_UINT[np_dt.itemsize]).numpy().view(np_dt)


def from_numpy(a: np.ndarray) -> torch.Tensor | None:
    """A CPU tensor sharing `a`'s memory, None where torch has no such dtype."""
    dt = torch_dtype(a.dtype)
    if dt is None:
        return None
    if dt in _NATIVE:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(np.dtype(f"u{a.dtype.itemsize}"))).view(dt)
