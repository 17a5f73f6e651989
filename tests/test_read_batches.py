"""How the read executor cuts a restore into batches and when their host buffers exist:
allocated when their batch is read, never before (so only one batch's buffers are alive),
and, for arrays bound for an accelerator, at most BATCH_ITEMS requests per batch."""

from __future__ import annotations

import os
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import snapshard
from snapshard.reading import BATCH_ITEMS, Dest, ReadStats, Request, execute
from snapshard.reading.requests import plan_of_boxes


def test_buffers_are_allocated_batch_by_batch(tmp_path, monkeypatch) -> None:
    """With a budget of three arrays, no request of a batch has buffers before every
    request of the previous batch is built."""
    state = {f"a{i:02d}": np.full((8, 8), i, np.float32) for i in range(10)}
    path = os.path.join(tmp_path, "c")
    snapshard.save(path, state)
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh) for k, v in state.items()}
    events: list[str] = []
    real_dests, real_finish = Request.dests, Request.finish

    def dests(r: Request) -> list[Dest]:
        events.append("alloc")
        return real_dests(r)

    def finish(r: Request) -> None:
        events.append("build")
        real_finish(r)

    monkeypatch.setattr(Request, "dests", dests)
    monkeypatch.setattr(Request, "finish", finish)
    out = snapshard.load(path, target, snapshard.ReadOptions(memory_budget=3 * 8 * 8 * 4))
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v)
    expected = ["alloc"] * 3 + ["build"] * 3
    assert events == expected * 3 + ["alloc", "build"]


class _Device:
    def __init__(self, platform: str) -> None:
        self.platform = platform


def _requests(n: int, platform: str) -> list[Request]:
    """`n` requests of 4 float32 each, one box each, bound for a device of `platform`."""
    device = _Device(platform)
    plan = plan_of_boxes((((0,), (4,), (device,)),), 4)
    leaf = SimpleNamespace(dtype="float32", shape=(4,))
    return [Request(leaf, "numpy", np.dtype(np.float32), box_plan=plan) for _ in range(n)]  # type: ignore[arg-type]


@pytest.mark.parametrize(("platform", "sizes"), [
    ("tpu", [BATCH_ITEMS, BATCH_ITEMS, 5000 - 2 * BATCH_ITEMS]),
    ("cpu", [5000]),  # a CPU array keeps its buffer: no bound on items there
])  # fmt: skip
def test_arrays_bound_for_an_accelerator_are_read_in_batches_of_batch_items(
    platform: str, sizes: list[int]
) -> None:
    reqs = _requests(5000, platform)
    seen: list[int] = []
    alive: list[int] = []

    def read(dests: list[Dest]) -> None:
        seen.append(len(dests))
        alive.append(sum(1 for r in reqs if r._buffers))  # buffers alive while a batch is read
        for d in dests:
            d.buf.view(np.float32)[:] = len(seen)

    out = execute(reqs, read, memory_budget=None, stats=ReadStats())
    assert seen == sizes
    assert alive == sizes  # the batch's own, none of the batches before or after it
    batch_of = [k + 1 for k, n in enumerate(sizes) for _ in range(n)]
    assert [int(v[0]) for v in out] == batch_of
    assert all(not r._buffers for r in reqs)
