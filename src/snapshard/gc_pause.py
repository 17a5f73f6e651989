"""Python's cyclic garbage collector paused while a restore, or a save's blocking phase, runs
in the caller's thread.

A restore makes some forty tracked objects per array (records, tables, views, boxes). Every
700 of them Python runs a collection, and the objects alive at that moment (most of them
the restore's, to be dropped at its end) are promoted towards the old generation, whose
full collections walk the whole heap: measured here, 40-100 ms of a 1000-array torch
restore of 0.12 s. Paused, the temporaries die by reference counting before any collection
sees them. The collector resumes when the outermost paused call returns, if it was on when
that call began; the background phase of an asynchronous save does not pause it (other
threads of the program would go without collections for as long).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_resume = False


@contextmanager
def collection_paused() -> Iterator[None]:
    """A context (and decorator) in which the cyclic collector does not run."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
