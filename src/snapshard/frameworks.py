"""The core's one seam toward the JAX wing: type checks that never import JAX, and the
operations the shared save and restore code asks of the wing.

A value can only be a `jax.Array` (or a JAX dtype) if whoever made it has imported JAX
already, so code shared by every framework asks `sys.modules` instead of importing JAX (0.4 s
in a fresh process, and absent from a PyTorch-only install).

Where the core meets such a value it asks `jax_wing()`: the `JaxWing` that `snapshard.jax`
registers when it is imported (jax/wing.py). The JAX-default entry points (`snapshard.save`,
`load`, the manager) import the wing first; the core itself never imports it, and the torch
wing never meets a jax.Array.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol

from .errors import SnapshardError

if TYPE_CHECKING:
    import numpy as np

    from .tree import Path


def jax_loaded() -> bool:
    return "jax" in sys.modules


def is_jax_array(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def is_shape_dtype_struct(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.ShapeDtypeStruct)


def is_prng_key_dtype(dtype: Any) -> bool:
    return jax_loaded() and jax_wing().key_dtype_is_prng(dtype)


class JaxWing(Protocol):
    """What the core asks of the JAX wing, each where it meets a JAX value (JAX is then
    loaded): saving a jax.Array leaf, the boxes and devices of a target sharding, building
    arrays and typed keys from host buffers, whether CPU donation keeps shared memory, the
    default save adapter, coordinator and manager framework.

    A SaveArray, SaveAdapter, Coordinator or Framework is typed Any: naming their classes
    would make this seam, the lowest of the core's modules, import the modules using it."""

    def save_array(self, path: Path, name: str, value: Any) -> Any: ...
    def key_dtype_is_prng(self, dtype: Any) -> bool: ...
    def is_abstract_mesh(self, mesh: Any) -> bool: ...
    def resolve_target_sharding(self, sharding: Any, mesh: Any, *, leaf: str) -> Any: ...
    def local_device_boxes(self, sharding: Any, shape: tuple[int, ...]) -> Any: ...
    def key_array(self, data: np.ndarray, impl: str | None, sharding: Any) -> Any: ...
    def array_from_host_boxes(
        self,
        shape: tuple[int, ...],
        sharding: Any,
        boxes: Any,
        hosts: list[np.ndarray],
        dtype: np.dtype | None = None,
    ) -> Any: ...
    def start_cpu_donation_check(self) -> None: ...
    def cpu_donation_keeps_memory(self) -> bool: ...
    def save_adapter(self, budget: int | None = None, snapshot: Any = None) -> Any: ...
    def coordinator(self) -> Any: ...
    def framework(self) -> Any: ...


_wing: JaxWing | None = None


def register_jax_wing(wing: JaxWing) -> None:
    """Called once by `snapshard.jax` when it is imported."""
    global _wing
    _wing = wing


def registered_jax_wing() -> JaxWing | None:
    return _wing  # (None: not imported; the default coordinator is then a local one)


def jax_wing() -> JaxWing:
    """The registered JAX wing; an error saying what to import when it was not."""
    if _wing is None:
        raise SnapshardError(
            "a JAX value met by code shared by every framework, with the JAX wing not "
            "loaded: use snapshard.save / snapshard.load (or import snapshard.jax first)"
        )
    return _wing


def default_save_adapter(budget: int | None = None, snapshot: Any = None) -> Any:
    """The save adapter of `snapshard.save` (the JAX wing's), for budget and snapshot."""
    if _wing is None:
        raise SnapshardError(
            "a save given no SaveAdapter uses the JAX wing's, which is not loaded: pass the "
            "wing's adapter, or save through snapshard.save (or import snapshard.jax first)"
        )
    return _wing.save_adapter(budget, snapshot)
