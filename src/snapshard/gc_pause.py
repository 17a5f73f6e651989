"""Python's cyclic garbage collector kept off the objects a save or restore makes.

A restore makes some forty tracked objects per array (records, tables, views, boxes), and a
save's blocking phase as many: its items, and JAX's own objects for every shard it touches
(a `jax.Array`'s single-device arrays and their shardings, some 26 per array, which live as
long as the array). Every 700 new objects Python runs a collection; the objects alive then
are traversed again in each younger generation they pass through, and once more by the
full collection their promotion soon sets off: measured here, 40-100 ms of a 1000-array
torch restore of 0.12 s, and 0.4-0.7 s after the blocking phase of a 10,000-array save,
run in the background thread while the caller waited for the interpreter lock.

So, three pieces:

- `collection_paused()`: no collection while a restore, or a save's blocking phase, runs in
  the caller's thread; temporaries die by reference counting before any collection sees
  them.
- When the outermost paused call returns, the objects that survived it are moved straight
  to the oldest generation (`gc.freeze()` then `gc.unfreeze()`: two list splices), so the
  collections that resume do not traverse them generation by generation. Only a full
  collection looks at them again, at its usual pace; cycles among them are found then.
- `Frozen`, for an asynchronous save: from the end of its blocking phase to the end of its
  background phase, every object alive at that moment sits in the permanent generation
  (`gc.freeze()`), which no collection traverses; the background phase itself and the
  caller's threads meanwhile collect their own new objects as usual. The last save to end
  moves them back to the oldest generation (`gc.unfreeze()`).

Where the program froze objects itself (`gc.get_freeze_count()` is not 0 and not ours, as
a server does before it forks), none of this touches the permanent generation, and the
collector resumes as it was. A program that calls `gc.freeze()` while an asynchronous save
runs sees those objects unfrozen with the save's when it ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # paused calls in progress
_resume = False  # whether the outermost paused call found the collector on
_frozen = 0  # Frozen holders in progress; the permanent generation is ours while > 0


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
                _promote_survivors()
                gc.enable()


def _promote_survivors() -> None:
    """Every tracked object into the oldest generation (the caller holds _lock)."""
    if _frozen:  # the permanent generation is ours: the survivors join it
        gc.freeze()
    elif gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


class Frozen:
    """Every object alive now kept out of collections until `release()` (an asynchronous
    save's staged items and the shards they view, for its background phase). Does nothing
    where the program froze objects itself. `release()` may be called more than once."""

    def __init__(self) -> None:
        global _frozen
        with _lock:
            self._held = bool(_frozen) or gc.get_freeze_count() == 0
            if self._held:
                gc.freeze()
                _frozen += 1

    def release(self) -> None:
        global _frozen
        with _lock:
            if not self._held:
                return
            self._held = False
            _frozen -= 1
            if _frozen == 0:
                gc.unfreeze()
