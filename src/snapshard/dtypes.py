"""Names of the dtypes snapshard stores, and the NumPy dtypes they map to.

Every dtype is stored in NumPy's in-memory layout, little-endian. The sub-byte types of
ml_dtypes (int4, uint4, int2, float4_e2m1fn, ...) take one byte per element in NumPy and
are stored that way: simple to read back, at the cost of unused bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import UnsupportedLeafError

_STANDARD = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
_ML_DTYPES = (
    "bfloat16",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
    "int1",
    "int2",
    "int4",
    "uint1",
    "uint2",
    "uint4",
)

NAME_TO_DTYPE: dict[str, np.dtype] = {n: np.dtype(n) for n in _STANDARD}
NAME_TO_DTYPE.update(
    {n: np.dtype(getattr(ml_dtypes, n)) for n in _ML_DTYPES if hasattr(ml_dtypes, n)}
)


def dtype_name(dtype: np.dtype | type, *, leaf: str = "?") -> str:
    """The stored name of a dtype; raises for dtypes that have no stable name (objects, strings)."""
    dt = np.dtype(dtype)
    name = dt.name
    if name in NAME_TO_DTYPE and NAME_TO_DTYPE[name] == dt:
        return name
    raise UnsupportedLeafError(f"leaf {leaf!r}: dtype {dt!r} cannot be stored")


def dtype_from_name(name: str) -> np.dtype:
    try:
        return NAME_TO_DTYPE[name]
    except KeyError:
        raise UnsupportedLeafError(f"unknown stored dtype {name!r}") from None


def little_endian(a: np.ndarray) -> np.ndarray:
    """The array in little-endian byte order (a no-op on little-endian hosts)."""
    if a.dtype.byteorder == ">":
        return a.astype(a.dtype.newbyteorder("<"))
    return a
