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

The full collections are kept at their pace. `gc.freeze()` also sets the youngest
generation's count of new objects back to 0, and that count is what sets off every
collection: the young ones, each tenth young one a middle one, each tenth of those a full
one. A program that saves at every step and makes fewer than 700 objects between two saves
(a jitted JAX step makes few) would never see a collection again, and every reference cycle
it or a save leaves (a manifest read holds one) would stay for as long as it runs: resident
memory growing with every save. So every move into the oldest generation counts the young
objects it moved, unexamined (the count it resets), and once they reach a quarter of the
objects the last full collection left, and at least 700 x 10 (CPython's own rule for a
full collection, which counts the survivors of young collections alike), a full collection
runs (`collect_if_due`) where no paused call or frozen save is in progress: at the end of
an asynchronous save's background phase (`Frozen.release`, and the manager's saves), and at
the end of a paused call once the count is twice that, so that a save's blocking phase
leaves the collection to the background phase that follows it, while a program that only
loads still has its cycles collected. A full collection of CPython's own clears the count.
What a save's blocking phase makes and leaves alive (its items, plan and views) is not
counted (`collection_paused(transient=True)`): it dies by reference counting when the save
ends, and counting it set off a full collection at nearly every save of a many-array state,
a traversal of the whole heap (85 ms at 10,000 JAX arrays) that stalls every thread.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # paused calls in progress
_resume = False  # whether the outermost paused call found the collector on
_limit: int | None = None  # the young objects the outermost paused call counts at most
_frozen = 0  # Frozen holders in progress; the permanent generation is ours while > 0
_moved = 0  # young objects moved to the oldest generation unexamined since a full collection
_full_seen = 0  # full collections CPython had made when _moved was last cleared
_long_lived = 0  # objects the last full collection made here left alive


@contextmanager
def collection_paused(transient: bool = False) -> Iterator[None]:
    """A context (and decorator) in which the cyclic collector does not run. `transient`:
    what the outermost call makes and leaves alive dies by reference counting when the work
    it started ends (a save's blocking phase: its items, plan and views, freed when the
    save ends), so only the young objects found on entry count toward the next full
    collection."""
    global _depth, _resume, _limit
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            _limit = max(gc.get_count()[0], 0) if transient else None
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            resumed = _depth == 0 and _resume
            if resumed:
                _promote_survivors(_limit)
                gc.enable()
        if resumed:
            collect_if_due(margin=2)  # a background phase that follows collects at 1


def _promote_survivors(limit: int | None = None) -> None:
    """Every tracked object into the oldest generation (the caller holds _lock); `limit`:
    the most young objects moved that count toward the next full collection."""
    if _frozen:  # the permanent generation is ours: the survivors join it
        _freeze(limit)
    elif gc.get_freeze_count() == 0:
        _freeze(limit)
        gc.unfreeze()


def _freeze(limit: int | None = None) -> None:
    """`gc.freeze()`, counting the young objects it moves past the young collections (at
    most `limit`; the caller holds _lock)."""
    global _moved, _full_seen
    full = gc.get_stats()[-1]["collections"]
    if full != _full_seen:  # CPython made a full collection since: what we moved was seen
        _moved, _full_seen = 0, full
    young = max(gc.get_count()[0], 0)
    _moved += young if limit is None else min(young, limit)
    gc.freeze()


def collect_if_due(margin: int = 1) -> bool:
    """Run a full collection if the young objects moved to the oldest generation without
    one call for it (see the module's doc; `margin`: how many times the usual count), unless
    a paused call or a frozen save is still in progress, or the collector is off; returns
    whether it ran."""
    global _moved, _full_seen, _long_lived
    with _lock:
        threshold = gc.get_threshold()
        floor = threshold[0] * (threshold[1] if len(threshold) > 1 else 1)
        due = (
            _depth == 0
            and _frozen == 0
            and gc.isenabled()
            and floor > 0
            and _moved >= margin * max(floor, _long_lived // 4)
        )
        if not due:
            return False
        _moved = 0
    gc.collect()  # (outside the lock: finalizers may pause or save)
    with _lock:
        _long_lived = len(gc.get_objects())
        _full_seen = gc.get_stats()[-1]["collections"]
    return True


class Frozen:
    """Every object alive now kept out of collections until `release()` (an asynchronous
    save's staged items and the shards they view, for its background phase). Does nothing
    where the program froze objects itself. `release()` may be called more than once."""

    def __init__(self) -> None:
        global _frozen
        with _lock:
            self._held = bool(_frozen) or gc.get_freeze_count() == 0
            if self._held:
                _freeze()
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
        collect_if_due()
