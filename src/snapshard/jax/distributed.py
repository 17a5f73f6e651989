"""Coordination through jax.distributed's coordination service.

This is the only module that talks to JAX's multi-controller runtime. The distributed client
is thread-safe, so saves may use it from their background thread.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..coordination.base import Coordinator
from ..errors import CoordinationError

T = TypeVar("T")
_LOST = ("UNAVAILABLE", "Socket closed", "Connection reset", "failed to connect", "CANCELLED")


def _is_deadline(e: BaseException) -> bool:
    return "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower()


def _ms(timeout_s: float) -> int:
    return max(1, int(timeout_s * 1000))


def _call(what: str, fn: Callable[[], T], late: str | None = None) -> T:
    """One call of the coordination client; a lost coordination service (it runs inside
    process 0) becomes a CoordinationError naming process 0, any other runtime error a
    CoordinationError naming the call. A deadline is a TimeoutError saying `late`, where
    given, else left to the caller."""
    try:
        return fn()
    except Exception as e:
        if _is_deadline(e) and late is not None:  # the runtime's own error type for deadlines
            raise TimeoutError(late) from None
        if _is_deadline(e) or "NOT_FOUND" in str(e) or "ALREADY_EXISTS" in str(e):
            raise
        first = str(e).split("\n", 1)[0][:300]
        if any(m in str(e) for m in _LOST):
            raise CoordinationError(
                f"lost contact with the coordination service during {what}: process 0, "
                f"which hosts it, died or is unreachable ({first})"
            ) from e
        raise CoordinationError(f"coordination service: {what} failed: {first}") from e


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
        _call(
            f"set of {key!r}", lambda: self._client.key_value_set(key, value, allow_overwrite=True)
        )

    def get(self, key: str, timeout_s: float) -> str:
        late = f"key {key!r} not set within {timeout_s:g} s"
        return str(
            _call(f"wait for {key!r}",
                  lambda: self._client.blocking_key_value_get(key, _ms(timeout_s)), late)
        )  # fmt: skip

    def try_get(self, key: str) -> str | None:
        try:
            return str(_call(f"read of {key!r}", lambda: self._client.key_value_try_get(key)))
        except CoordinationError:
            raise
        except Exception as e:
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise

    def barrier(self, name: str, timeout_s: float) -> None:
        late = f"barrier {name!r} not reached within {timeout_s:g} s"
        _call(f"barrier {name!r}", lambda: self._client.wait_at_barrier(name, _ms(timeout_s)), late)

    def get_dir(self, prefix: str) -> dict[str, str]:
        base = prefix.rstrip("/") + "/"
        pairs = _call(f"listing of {base!r}", lambda: self._client.key_value_dir_get(base))
        return {str(k).removeprefix(base): str(v) for k, v in pairs}

    def delete(self, prefix: str, keys: Sequence[str] | None = None) -> None:
        base = prefix.rstrip("/")
        _call(f"deletion of {base!r}", lambda: self._client.key_value_delete(base))

    def increment(self, key: str, by: int = 1) -> int:
        return int(
            _call(f"increment of {key!r}", lambda: self._client.key_value_increment(key, by))
        )

    def set_if_absent(self, key: str, value: str) -> str:
        try:
            _call(f"set of {key!r}", lambda: self._client.key_value_set(key, value))
            return value
        except CoordinationError:
            raise
        except Exception as e:
            if "ALREADY_EXISTS" not in str(e):
                raise
        return self.get(key, 60.0)


def distributed_is_initialized() -> bool:
    if "jax" not in sys.modules:  # (jax.distributed cannot run without JAX imported)
        return False
    from jax._src import distributed

    return distributed.global_state.client is not None


def preemption_sync_point(step: int) -> bool | None:
    """JAX's preemption sync point, or None where the preemption service is not running."""
    if not distributed_is_initialized():
        return None
    from jax._src import distributed
    from jax.experimental import multihost_utils

    if distributed.global_state.preemption_sync_manager is None:
        return None
    return bool(multihost_utils.reached_preemption_sync_point(step))


_distributed: JaxDistributedCoordinator | None = None


def distributed_coordinator() -> JaxDistributedCoordinator | None:
    """The coordinator over jax.distributed when it is initialized with several processes
    (one per process, made on first use), else None."""
    global _distributed
    if not distributed_is_initialized():
        return None
    import jax

    if jax.process_count() <= 1:
        return None
    if _distributed is None:
        _distributed = JaxDistributedCoordinator()
    return _distributed
