"""The coordination interface: a small key-value store and barriers shared by all processes.

Saves use it only after writing: each process reports that its files are durable, one
process merges and commits, and every process learns the outcome.
"""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence


class Coordinator(ABC):
    process_index: int
    process_count: int

    @property
    def is_leader(self) -> bool:
        return self.process_index == 0

    @abstractmethod
    def set(self, key: str, value: str) -> None: ...

    @abstractmethod
    def get(self, key: str, timeout_s: float) -> str:
        """Wait for `key`; raises TimeoutError when it does not appear in time."""

    @abstractmethod
    def try_get(self, key: str) -> str | None: ...

    @abstractmethod
    def barrier(self, name: str, timeout_s: float) -> None: ...

    @abstractmethod
    def get_dir(self, prefix: str) -> dict[str, str]:
        """Every key under `prefix/` that is set now (key relative to the prefix), in one
        round trip."""

    @abstractmethod
    def delete(self, prefix: str, keys: Sequence[str] | None = None) -> None:
        """Remove `prefix` and every key under `prefix/`. `keys`: the names under `prefix`
        that can exist there, where the caller knows them; a store that cannot list its
        keys (c10d's) then deletes those alone instead of every name it might hold."""

    @abstractmethod
    def increment(self, key: str, by: int = 1) -> int:
        """Add `by` to the counter at `key` (0 if unset) and return the new value, atomically."""

    def job_token(self) -> str:
        """A random token, the same on every process of this job and different between jobs
        (the first process to ask sets it; one round trip, once per process)."""
        token: str | None = getattr(self, "_job_token", None)
        if token is None:
            token = self.set_if_absent("snapshard/job-token", uuid.uuid4().hex[:12])
            self._job_token = token
        return token

    def set_if_absent(self, key: str, value: str) -> str:
        """Set `key` unless it is set; returns the value that stays (the first setter's)."""
        current = self.try_get(key)
        if current is None:
            self.set(key, value)
            return value
        return current


class SingleProcessCoordinator(Coordinator):
    """One process: the key-value store is a dict, safe to use from background threads."""

    def __init__(self) -> None:
        self.process_index = 0
        self.process_count = 1
        self._kv: dict[str, str] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._cond:
            self._kv[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._kv:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"key {key!r} not set within {timeout_s:g} s")
                self._cond.wait(left)
            return self._kv[key]

    def try_get(self, key: str) -> str | None:
        with self._cond:
            return self._kv.get(key)

    def barrier(self, name: str, timeout_s: float) -> None:
        return None

    def get_dir(self, prefix: str) -> dict[str, str]:
        base = prefix.rstrip("/") + "/"
        with self._cond:
            return {k[len(base) :]: v for k, v in self._kv.items() if k.startswith(base)}

    def delete(self, prefix: str, keys: Sequence[str] | None = None) -> None:
        base = prefix.rstrip("/")
        with self._cond:
            for k in [k for k in self._kv if k == base or k.startswith(base + "/")]:
                del self._kv[k]

    def increment(self, key: str, by: int = 1) -> int:
        with self._cond:
            n = int(self._kv.get(key, "0")) + by
            self._kv[key] = str(n)
            self._cond.notify_all()
            return n

    def set_if_absent(self, key: str, value: str) -> str:
        with self._cond:
            return self._kv.setdefault(key, value)

    def keys(self) -> list[str]:
        """Every key set now but the job token (for tests: an operation leaves none behind)."""
        with self._cond:
            return sorted(k for k in self._kv if k != "snapshard/job-token")
