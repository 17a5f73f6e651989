"""The coordination interface: a small key-value store and barriers shared by all processes.

Saves use it only after writing: each process reports that its files are durable, one
process merges and commits, and every process learns the outcome.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod


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
