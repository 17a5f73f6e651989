"""Coordination through jax.distributed's coordination service.

This is the only module that talks to JAX's multi-controller runtime. The distributed client
is thread-safe, so saves may use it from their background thread.
"""

from __future__ import annotations

from typing import Any

from .base import Coordinator


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class JaxDistributedCoordinator(Coordinator):
    def __init__(self) -> None:
        import jax

        self._client = _client()
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()

    def set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def get(self, key: str, timeout_s: float) -> str:
        try:
            return str(self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000))))
        except Exception as e:  # the runtime raises its own error type for deadlines
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                raise TimeoutError(f"key {key!r} not set within {timeout_s:g} s") from None
            raise

    def try_get(self, key: str) -> str | None:
        try:
            return str(self._client.key_value_try_get(key))
        except Exception as e:
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def barrier(self, name: str, timeout_s: float) -> None:
        self._client.wait_at_barrier(name, max(1, int(timeout_s * 1000)))


def distributed_is_initialized() -> bool:
    from jax._src import distributed

    return distributed.global_state.client is not None


def preemption_sync_point(step: int) -> bool:
    """JAX's preemption sync point, or False where the preemption service is not running."""
    from jax._src import distributed
    from jax.experimental import multihost_utils

    if distributed.global_state.preemption_sync_manager is None:
        return False
    return bool(multihost_utils.reached_preemption_sync_point(step))
