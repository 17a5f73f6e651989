"""A function running in a background thread whose error is kept for whoever waits on it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger("snapshard")
T = TypeVar("T")


class BackgroundTask(Generic[T]):
    """Runs `fn` in a thread; `wait()` returns its result or raises its error.

    The thread is not a daemon: a program that ends while the task runs waits for it rather
    than leaving a checkpoint half written. A failure is logged when it happens.
    """

    def __init__(self, fn: Callable[[], T], name: str):
        self.name = name
        self._fn = fn
        self._result: T | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"snapshard: {name}", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        # Give the GIL back at once: the starting thread waits in start() until this one
        # runs, and would otherwise wait a whole switch interval (5 ms) more to take it back
        # from a task that computes; that wait is in the caller's blocking phase.
        time.sleep(0)
        try:
            self._result = self._fn()
        except BaseException as e:
            self._error = e
            log.error("background %s failed: %s: %s", self.name, type(e).__name__, e)
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> T:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self.name} still running after {timeout} s")
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]
