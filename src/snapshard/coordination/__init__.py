"""How processes agree: a single-process coordinator, or jax.distributed's coordination service."""

from __future__ import annotations

from .base import Coordinator, SingleProcessCoordinator
from .jax_distributed import JaxDistributedCoordinator, distributed_is_initialized

_single: SingleProcessCoordinator | None = None
_distributed: JaxDistributedCoordinator | None = None


def default_coordinator() -> Coordinator:
    """jax.distributed's when it is initialized with several processes, else a local one."""
    global _single, _distributed
    if distributed_is_initialized():
        import jax

        if jax.process_count() > 1:
            if _distributed is None:
                _distributed = JaxDistributedCoordinator()
            return _distributed
    if _single is None:
        _single = SingleProcessCoordinator()
    return _single


__all__ = [
    "Coordinator",
    "JaxDistributedCoordinator",
    "SingleProcessCoordinator",
    "default_coordinator",
]
