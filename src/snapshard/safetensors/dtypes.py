"""safetensors dtype names and the NumPy (ml_dtypes) dtypes they are read into."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from ..errors import UnsupportedLeafError

# name -> (bits per element, NumPy dtype or None where NumPy has no byte-addressable match)
DTYPES: dict[str, tuple[int, np.dtype | None]] = {
    "BOOL": (8, np.dtype(bool)),
    "U8": (8, np.dtype(np.uint8)),
    "I8": (8, np.dtype(np.int8)),
    "U16": (16, np.dtype(np.uint16)),
    "I16": (16, np.dtype(np.int16)),
    "U32": (32, np.dtype(np.uint32)),
    "I32": (32, np.dtype(np.int32)),
    "U64": (64, np.dtype(np.uint64)),
    "I64": (64, np.dtype(np.int64)),
    "F16": (16, np.dtype(np.float16)),
    "BF16": (16, np.dtype(ml_dtypes.bfloat16)),
    "F32": (32, np.dtype(np.float32)),
    "F64": (64, np.dtype(np.float64)),
    "C64": (64, np.dtype(np.complex64)),
    # torch and the safetensors library read F8_E4M3 as float8_e4m3fn.
    "F8_E4M3": (8, np.dtype(ml_dtypes.float8_e4m3fn)),
    "F8_E5M2": (8, np.dtype(ml_dtypes.float8_e5m2)),
    "F8_E4M3FNUZ": (8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
    "F8_E5M2FNUZ": (8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
    "F8_E8M0": (8, np.dtype(ml_dtypes.float8_e8m0fnu)),
    # Bit-packed: two (F4) or four-in-three-bytes (F6) elements per byte run.
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
}

_NAME_OF = {dt: name for name, (_, dt) in DTYPES.items() if dt is not None}


def numpy_dtype(name: str, where: str) -> np.dtype:
    """The NumPy dtype a tensor of safetensors dtype `name` is read into."""
    dt = DTYPES[name][1]
    if dt is None:
        raise UnsupportedLeafError(
            f"{where}: dtype {name} is bit-packed ({DTYPES[name][0]} bits per element); "
            "snapshard reads only byte-addressable dtypes"
        )
    return dt


def safetensors_name(dtype: np.dtype, where: str) -> str:
    """The safetensors name of a NumPy dtype; raises for dtypes the format cannot hold."""
    name = _NAME_OF.get(np.dtype(dtype))
    if name is None:
        raise UnsupportedLeafError(
            f"{where}: dtype {np.dtype(dtype).name} has no safetensors equivalent"
        )
    return name
