"""Coordination over torch.distributed's key-value store (the c10d Store of the process group).

A save uses the store for its two rendezvous (reports to rank 0, rank 0's outcome), exactly
as with jax.distributed: no collective, no barrier. Waits poll the store (`check`, then
`get`) rather than blocking inside it, so that a long wait from a save's background thread
never holds the store client while the training loop's thread uses it, and so that every
timeout is ours, with an error naming the ranks that did not report.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..coordination.base import Coordinator, SingleProcessCoordinator
from ..errors import CoordinationError

_POLL_MIN_S = 0.0001  # a poll is one store round trip; the pause doubles up to a cap
# The cap grows with the ranks that may poll one key at once (every rank but 0 waits for
# the outcome of a save), holding the store to a few thousand requests a second: 2 ms
# with 8 ranks, 50 ms from 200. A cap of 50 ms at any size made a rank's wake-up lag the
# key by 25 ms on average, on saves that take a few hundred.
_POLL_PER_RANK_S, _POLL_LEAST_S, _POLL_MOST_S = 0.00025, 0.001, 0.05


class TorchStoreCoordinator(Coordinator):
    """A Coordinator over a c10d Store (TCPStore, FileStore, HashStore, PrefixStore...)."""

    def __init__(
        self, store: Any = None, rank: int | None = None, world_size: int | None = None
    ) -> None:
        import torch.distributed as dist

        if store is None:
            if not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialized")
            store = dist.distributed_c10d._get_default_store()
        self._store = store
        self.process_index = dist.get_rank() if rank is None else int(rank)
        self.process_count = dist.get_world_size() if world_size is None else int(world_size)
        per_rank = self.process_count * _POLL_PER_RANK_S
        self._poll_max_s = min(max(per_rank, _POLL_LEAST_S), _POLL_MOST_S)
        self._barriers: dict[str, int] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def try_get(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode()

    def get_dir(self, prefix: str) -> dict[str, str]:
        """A c10d store cannot list keys: the keys looked for are `prefix/<rank>` (what the
        rendezvous' reports are), read in one request when all are there."""
        keys = [f"{prefix}/{r}" for r in range(self.process_count)]
        multi_get = getattr(self._store, "multi_get", None)
        if multi_get is not None and self._store.check(keys):
            return {str(r): bytes(v).decode() for r, v in enumerate(multi_get(keys))}
        return {str(r): v for r, k in enumerate(keys) if (v := self.try_get(k)) is not None}

    def delete(self, prefix: str, keys: Sequence[str] | None = None) -> None:
        """Remove `keys` under `prefix`, else every key a rendezvous under `prefix` may set:
        a c10d store cannot list its keys, and deletes them one request each."""
        if keys is not None:
            names = [f"{prefix}/{k}" for k in keys]
        else:
            names = [prefix, f"{prefix}/outcome", f"{prefix}/seen"]
            names += [f"{prefix}/{r}" for r in range(self.process_count)]
            names += [
                f"{prefix}/{k}/{r}" for k in ("written", "read") for r in range(self.process_count)
            ]
        for k in names:
            with contextlib.suppress(Exception):
                self._store.delete_key(k)

    def set_if_absent(self, key: str, value: str) -> str:
        """Atomically, through the store's compare-and-set (an empty expected value matches
        a missing key)."""
        return bytes(self._store.compare_set(key, "", value)).decode()

    def increment(self, key: str, by: int = 1) -> int:
        return int(self._store.add(key, by))

    def get(self, key: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        pause = _POLL_MIN_S
        while True:
            value = self.try_get(key)
            if value is not None:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"key {key!r} not set within {timeout_s:g} s")
            time.sleep(min(pause, left))
            pause = min(pause * 2, self._poll_max_s)

    def barrier(self, name: str, timeout_s: float) -> None:
        """Every rank sets its own key, then waits for all; the n-th barrier of a name has
        its own keys, so names may be reused."""
        with self._lock:
            n = self._barriers.get(name, 0)
            self._barriers[name] = n + 1
        prefix = f"snapshard/barrier/{name}/{n}"
        self.set(f"{prefix}/{self.process_index}", "1")
        deadline = time.monotonic() + timeout_s
        pending = [p for p in range(self.process_count) if p != self.process_index]
        pause = _POLL_MIN_S
        while pending:
            pending = [p for p in pending if not self._store.check([f"{prefix}/{p}"])]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise CoordinationError(
                    f"barrier {name!r}: rank(s) {pending} did not arrive within {timeout_s:g} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, self._poll_max_s)


_default: tuple[Any, TorchStoreCoordinator] | None = None
_single: SingleProcessCoordinator | None = None


def default_coordinator() -> Coordinator:
    """The default process group's store when torch.distributed runs several ranks, else a
    single-process coordinator."""
    global _default, _single
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.distributed_c10d._get_default_store()
        if _default is None or _default[0] is not store:
            _default = (store, TorchStoreCoordinator(store))
        return _default[1]
    if _single is None:
        _single = SingleProcessCoordinator()
    return _single
