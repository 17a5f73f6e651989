"""How many data files each process writes in parallel, chosen from what the storage does.

Which count is fastest depends on the storage and drifts with its load: on one disk one
writer thread reaches the limit and a second only adds seeks; on another (or an object
store, where every file is its own stream of requests) two or more are needed. A save with
`SaveOptions(writers=None)` asks the `WriterCounts` of its location's parent (the disk, or
the bucket a manager's steps share) for a count and reports the write throughput it reached
with it.
The first `FIRST_SAVES` saves use the default count (a process that saves once, or a
manager's first steps, behave as before), then each other candidate is tried once, then the
one with the best recent median is used (the default unless another is `MARGIN` faster:
noise must not make the choice flap), and every `EXPLORE_EVERY`-th save tries another to
follow drift. Saves of under `MIN_BYTES` per process measure nothing useful and keep
`DEFAULT_COUNT`. The choice is per process: the file count is each process's own (its
report lists its files), so no agreement is needed.
"""

from __future__ import annotations

import os
import statistics
import threading
from dataclasses import dataclass, field

DEFAULT_COUNT = 2
MIN_BYTES = 64 << 20
EXPLORE_EVERY = 8
FIRST_SAVES = 2  # saves with the default count before another is tried
MARGIN = 1.1  # another count is used only when its median throughput is this much higher
_KEEP = 3  # measurements kept per candidate

LOCAL_CANDIDATES = (1, 2)
OBJECT_STORE_CANDIDATES = (2, 4)


@dataclass
class WriterCounts:
    """Measured write throughput (bytes/s) per file count for one storage location."""

    candidates: tuple[int, ...]
    history: dict[int, list[float]] = field(default_factory=dict)
    saves: int = 0

    @property
    def default(self) -> int:
        return DEFAULT_COUNT if DEFAULT_COUNT in self.candidates else self.candidates[0]

    def choose(self, nbytes: int) -> int:
        first = self.default
        if nbytes < MIN_BYTES:
            return first
        self.saves += 1
        if len(self.history.get(first, ())) < FIRST_SAVES:
            return first
        untried = [n for n in self.candidates if not self.history.get(n)]
        if untried:
            return untried[0]
        rate = {n: statistics.median(self.history[n]) for n in self.candidates}
        best = max(self.candidates, key=lambda n: rate[n])
        if rate[best] < MARGIN * rate[first]:
            best = first  # noise would make the choice flap: leave the default only for a clear win
        if self.saves % EXPLORE_EVERY == 0:
            others = [n for n in self.candidates if n != best]
            return others[(self.saves // EXPLORE_EVERY) % len(others)] if others else best
        return best

    def record(self, count: int, nbytes: int, seconds: float) -> None:
        if nbytes < MIN_BYTES or seconds <= 0 or count not in self.candidates:
            return
        kept = self.history.setdefault(count, [])
        kept.append(nbytes / seconds)
        del kept[:-_KEEP]


_by_location: dict[str, WriterCounts] = {}
_lock = threading.Lock()


def counts_for(url: str, object_store: bool) -> WriterCounts:
    """The tuner shared by every save under the same parent location in this process."""
    key = os.path.dirname(url.rstrip("/"))
    with _lock:
        if key not in _by_location:
            cands = OBJECT_STORE_CANDIDATES if object_store else LOCAL_CANDIDATES
            _by_location[key] = WriterCounts(cands)
        return _by_location[key]
