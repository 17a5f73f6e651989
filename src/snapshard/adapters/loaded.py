"""JAX as an adapter, not a requirement: type checks that never import it.

A value can only be a `jax.Array` (or a JAX dtype) if whoever made it has imported JAX
already, so code shared by every framework asks `sys.modules` instead of importing JAX (0.4 s
in a fresh process, and absent from a PyTorch-only install).
"""

from __future__ import annotations

import sys
from typing import Any


def jax_loaded() -> bool:
    return "jax" in sys.modules


def is_jax_array(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def is_shape_dtype_struct(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.ShapeDtypeStruct)


def is_prng_key_dtype(dtype: Any) -> bool:
    if not jax_loaded():
        return False
    from .jax_arrays import key_dtype_is_prng

    return key_dtype_is_prng(dtype)
