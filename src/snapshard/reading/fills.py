"""The restore's seam toward a target: `Fill`, and the one batch loop over fills.

A `Fill` is one target's part of a restore, whoever made it: a JAX or NumPy leaf
(requests.py), a region of a torch tensor (torch/target_fills.py), a DCP read item
(torch/dcp_reading.py). The twin of the save's `SaveAdapter`: what a target needs, where its
bytes go, how it is finished.

Call order of `fill(fills, read, stats, ...)`, batch by batch (`buffers.batches`: at most
`budget` bytes of `Fill.buffered`, at most `most` fills):

1. `Fill.dests()` of each fill of the batch: its destinations, host buffers made now (or
   the target's own memory), so that only one batch's buffers are alive at a time;
2. `expand` (readers of other formats): the destinations swapped for those actually
   stored, and steps that fill the former from the latter;
3. `read` fills every destination of the batch (a source's `ReadDests`), then the steps run;
4. `Fill.finish()` of each fill: cast, copy or build into the target, buffers dropped.

An exception of any step propagates at once; the fills not finished keep their targets as
they were (a caller that must tell its peers first catches it around `fill`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from .buffers import Dest, ReadDests, ReadStats, batches

# Turns the destination buffers of a batch into the buffers actually read from storage, and
# the steps that fill the former from the latter once read (in order). Readers of other
# formats use it for arrays computed from stored ones (snapshard.safetensors transforms).
Expand = Callable[[list[Dest]], tuple[list[Dest], list[Callable[[], None]]]]


class Fill(Protocol):
    """One target's part of a restore (see the module docstring for the call order)."""

    @property
    def buffered(self) -> int:
        """The host bytes this fill holds while its batch is read (0: it reads in place)."""
        ...

    def dests(self) -> list[Dest]:
        """Where its bytes land: buffers made now, or the target's own memory."""
        ...

    def finish(self) -> None:
        """Move what was read into the target and drop the buffers."""
        ...


def fill(
    fills: Sequence[Fill],
    read: ReadDests,
    stats: ReadStats,
    *,
    budget: int | None,
    most: int | None = None,
    expand: Expand | None = None,
) -> None:
    """Fill every target of `fills` from `read`, in batches of at most `budget` buffered
    bytes (None: no bound) and `most` fills (None: no bound); `stats` takes the time spent
    reading and finishing."""
    for batch in batches(fills, lambda f: f.buffered, budget, most):
        t0 = time.perf_counter()
        dests = [d for f in batch for d in f.dests()]
        steps: list[Callable[[], None]] = []
        if expand is not None:
            dests, steps = expand(dests)
        read(dests)
        for step in steps:
            step()
        del dests, steps  # (the batch's buffers die with its fills, not with the next batch)
        t1 = time.perf_counter()
        for f in batch:
            f.finish()
        stats.read_s += t1 - t0
        stats.assemble_s += time.perf_counter() - t1
