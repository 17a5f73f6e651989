"""The entry point of every reader of the package: requests read and built in batches.

`execute(requests, read)` cuts the requests into batches under the memory budget (jax.Array
targets only), allocates each batch's host buffers, has `read` (a source's `ReadDests`) fill
them and builds the values (requests.py) before the next batch is allocated.

On the CPU backend a jax.Array keeps its host buffer (XLA aliases it), so batches there
only bound the bytes. On an accelerator a buffer is dropped once its device copy is made;
batches of at most `BATCH_ITEMS` requests then keep the host memory of a restore of many
small arrays (buffers and the objects of their reads) a fraction of the state's, not all
of it at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..frameworks import jax_wing
from .buffers import BATCH_ITEMS, Dest, ReadDests, ReadStats, batches
from .requests import Request, build, with_buffers

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
    plans = {id(r.box_plan): r.box_plan for r in reqs if r.box_plan is not None}
    box_devices = [devs for p in plans.values() for _, _, devs in p.boxes if devs]
    if any(len(devs) > 1 and devs[0].platform == "cpu" for devs in box_devices):
        jax_wing().start_cpu_donation_check()  # overlaps the reads (see array_from_host_boxes)
    on_device = any(devs[0].platform != "cpu" for devs in box_devices)
    results: dict[int, Any] = {}
    for batch in batches(reqs, lambda r: r.nbytes, budget, BATCH_ITEMS if on_device else None):
        t0 = time.perf_counter()
        dests = [d for r in batch for d in with_buffers(r)]
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
