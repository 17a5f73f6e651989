"""How processes agree: the coordinator protocol, a single-process coordinator, and the
default one: the JAX wing's over jax.distributed when it runs several processes (registered
with `frameworks.py` when `snapshard.jax` is imported), else a local one."""

from __future__ import annotations

from ..frameworks import registered_jax_wing
from .base import Coordinator, SingleProcessCoordinator

_single: SingleProcessCoordinator | None = None


def default_coordinator() -> Coordinator:
    """jax.distributed's when it is initialized with several processes and the JAX wing is
    loaded (`snapshard.save`, `load` and the manager load it), else a local one."""
    global _single
    wing = registered_jax_wing()
    found = wing.coordinator() if wing is not None else None
    if found is not None:
        return found
    if _single is None:
        _single = SingleProcessCoordinator()
    return _single


__all__ = [
    "Coordinator",
    "SingleProcessCoordinator",
    "default_coordinator",
]
