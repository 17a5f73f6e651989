"""The entry point of every reader of the package: requests read and built in batches.

`execute(requests, read)` cuts the requests into batches under the memory budget (jax.Array
targets only), has `read` (a source's `ReadDests`) fill each batch's host buffers and builds
the values (requests.py) before the next batch is allocated.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .buffers import Dest, ReadDests, ReadStats, batches
from .requests import Request, build

# Turns the destination buffers of a batch into the buffers actually read from storage, and
# the steps that fill the former from the latter once read (in order). Readers of other
# formats use it for arrays computed from stored ones (snapshard.safetensors transforms).
Expand = Callable[[list[Dest]], tuple[list[Dest], list[Callable[[], None]]]]


def execute(
    reqs: list[Request],
    read: ReadDests,
    *,
    memory_budget: int | None,
    stats: ReadStats,
    expand: Expand | None = None,
) -> list[Any]:
    """Read and build every request, in batches that fit the memory budget (jax.Arrays only).

    Returns the built values in the order of `reqs`.
    """
    budget = None if all(r.kind in ("numpy", "scalar") for r in reqs) else memory_budget
    if any(len(d.devices) > 1 and d.devices[0].platform == "cpu" for r in reqs for d in r.dests):
        from ..adapters.jax_arrays import start_cpu_donation_check

        start_cpu_donation_check()  # overlaps the reads (see array_from_host_boxes)
    results: dict[int, Any] = {}
    for batch in batches(reqs, lambda r: r.nbytes, budget):
        t0 = time.perf_counter()
        dests = [d for r in batch for d in r.dests]
        steps: list[Callable[[], None]] = []
        if expand is not None:
            dests, steps = expand(dests)
        read(dests)
        for step in steps:
            step()
        t1 = time.perf_counter()
        for r in batch:
            results[id(r)] = build(r)
            r.dests.clear()
        stats.read_s += t1 - t0
        stats.assemble_s += time.perf_counter() - t1
    return [results[id(r)] for r in reqs]
