"""Saving torch state dicts through snapshard's save executor.

The blocking phase stages this rank's planned boxes on the host:

- synchronous saves on CPU: NumPy views of the tensors' memory (the caller waits for the
  whole save, so nothing can change underneath; no copy);
- asynchronous saves (and any CUDA tensor): every owned byte is copied into host buffers
  before returning, since ``optimizer.step()`` updates tensors in place. Buffers are reused
  from one save to the next (pinned memory for CUDA sources, which are copied with
  ``non_blocking`` on a side stream that is synchronised before returning): a
  CheckpointManager's saves take them from the manager's own pool, released by its
  ``close()``; ``save_async`` from the process's pool.

``SaveOptions.host_budget`` is not honoured here: the background phase cannot copy a slice
that the next optimizer step may already have changed in place, so every byte this rank
writes is copied in the blocking phase (its bytes are the save's ``bytes_staged``), and the
pool then holds exactly those bytes until the next save or ``close()``.

Writing, reporting, merging, validating and committing are snapshard's own (saving.finish).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import saving as _saving
from ..format.leaves import Leaf
from ..manager.framework import StartedSave
from ..options import SaveOptions
from ..planning import WritePlan
from ..reading import aligned_empty
from ..saving.save_array import SaveArray
from ..saving.staging import Borrower, HostPool, StagedItem, current_pool, planned_items
from ..storage import Location, Storage
from ..tree import Path
from . import leaves as _leaves
from .coordination import default_coordinator
from .dtypes import host_view

Buffer = tuple[np.ndarray, torch.Tensor | None]  # the bytes, and their pinned tensor


def _allocate(nbytes: int, pinned: bool) -> Buffer:
    if pinned:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return t.numpy(), t
    return aligned_empty(nbytes), None


class HostBuffers(HostPool[Buffer]):
    """Host buffers reused across asynchronous saves, by exact byte size, pinned or not
    (staging.HostPool: a save takes the buffers it needs and gives them all back when its
    background phase ends; buffers no save asked for in a round are dropped, so memory
    stays at what the saves in flight need; `close()` releases them)."""

    def take(self, nbytes: int, pinned: bool) -> Buffer:
        return self._take((nbytes, pinned), lambda: _allocate(nbytes, pinned))

    def borrower(self) -> Borrower[[int, bool], Buffer]:
        """What one save borrows (staging.Borrower: `take(nbytes, pinned)`, `release()`)."""
        return Borrower(self, self.take)

    def _key(self, entry: Buffer) -> tuple[int, bool]:
        return (entry[0].nbytes, entry[1] is not None)

    def _entry_bytes(self, entry: Buffer) -> int:
        return int(entry[0].nbytes)

    def close(self) -> None:
        """Release every buffer held, and (pinned ones) the allocator's cache of them."""
        with self._lock:
            pinned = any(b[1] is not None for v in self._free.values() for b in v)
        super().close()
        empty = getattr(torch._C, "_host_emptyCache", None)
        if pinned and empty is not None:  # torch caches freed pinned blocks for reuse
            empty()


_buffers = HostBuffers()  # save_async's, for the process (a manager has its own)


class TorchAdapter:
    """snapshard.saving.SaveAdapter for torch state dicts."""

    def __init__(self, buffers: HostBuffers | None, trees_differ: bool = False) -> None:
        self.borrowed = buffers.borrower() if buffers is not None else None
        self.trees_differ = trees_differ  # SaveOptions.trees_differ
        self.rank = _leaves.this_rank()  # asked once per save, not once per leaf

    def is_leaf(self, x: Any) -> bool:
        return _leaves.is_leaf(x)

    def mesh_of(self, arr: SaveArray) -> None:
        """DTensor layouts are stored as explicit rows."""
        return None

    @property
    def taken(self) -> list[Buffer]:
        """The pool's buffers this save holds (none without a pool)."""
        return self.borrowed.taken if self.borrowed is not None else []

    def release(self) -> None:
        """The host buffers this save took go back to the pool for the next one."""
        if self.borrowed is not None:
            self.borrowed.release()

    def classify(self, path: Path, value: Any, process_count: int) -> Leaf | SaveArray:
        return _leaves.classify(path, value, process_count, self.rank, self.trees_differ)

    def _buffer(self, nbytes: int, pinned: bool) -> Buffer:
        if self.borrowed is None:
            return _allocate(nbytes, pinned)
        return self.borrowed.take(nbytes, pinned)

    def stage(
        self, arrays: list[tuple[int, SaveArray]], plan: WritePlan, process: int, *, copy: bool
    ) -> tuple[list[StagedItem], int]:
        items: list[StagedItem] = []
        used = 0
        streams: dict[torch.device, Any] = {}
        for item, _, arr, row in planned_items(arrays, plan, process):
            items.append(item)
            src = arr.source
            if isinstance(src, _leaves.TorchSource):
                local = src.local
                # A box as large as the local tensor, and inside it, is all of it: no view.
                if item.nbytes != local.nbytes:
                    local = local[_leaves.row_slices(arr, row, item.start, item.stop)]
                if local.device.type != "cpu":
                    item.host = self._to_pinned(local, item.nbytes, arr.dtype, streams)
                    used += item.nbytes
                    continue
                view = host_view(local)
            else:  # a NumPy leaf
                view = np.asarray(src)[_leaves.row_slices(arr, row, item.start, item.stop)]
            if copy:
                dst = self._buffer(item.nbytes, False)[0].view(view.dtype).reshape(view.shape)
                np.copyto(dst, view)
                view, used = dst, used + item.nbytes
            item.host = view
        for s in streams.values():
            s.synchronize()
        return items, used

    def _to_pinned(
        self, local: torch.Tensor, nbytes: int, dtype: np.dtype, streams: dict[torch.device, Any]
    ) -> np.ndarray:
        """A non-blocking copy of a device tensor into a pinned buffer, on a side stream that
        first waits for the current one (the caller synchronises the streams)."""
        buf, pinned = self._buffer(nbytes, True)
        assert pinned is not None
        dev = local.device
        if dev not in streams:
            s = torch.cuda.Stream(device=dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            streams[dev] = s
        shape = tuple(local.shape)
        with torch.cuda.stream(streams[dev]):
            pinned.view(local.dtype).view(shape).copy_(local.detach(), non_blocking=True)
        return buf.view(dtype).reshape(shape)


def start_save(
    directory: Location | Storage,
    state_dict: Any,
    options: SaveOptions = SaveOptions(),
    *,
    asynchronous: bool = True,
    buffers: HostBuffers | None = None,
    coordinator: Any = None,
    snapshot: Any = None,
    **prepare_args: Any,
) -> StartedSave:
    """The blocking phase of a save of a torch state dict (`prepare_args`: the keywords of
    saving.prepare), for the manager's TORCH framework.

    Asynchronous (the default): every byte this rank writes is copied into host buffers
    (from `buffers`; by default the pool of the manager that starts the save, see
    staging.pools_for_saves, else the process's) before returning, whatever
    `options.host_budget` says (see the module's doc), and the buffers go back to the pool
    when the background phase, `finish()`, ends, however it ends. Synchronous: CPU tensors
    are staged as views of their memory, so the caller must not change them before
    `finish()` returns.
    `snapshot` is taken for the manager's sake and unused."""
    del snapshot
    prep = _saving.prepare(
        directory, state_dict, options, coordinator=coordinator or default_coordinator(),
        asynchronous=asynchronous, adapter=adapter_for(options, asynchronous, buffers),
        **prepare_args,
    )  # fmt: skip
    return StartedSave(prep.timings, lambda: _saving.finish(prep))


def adapter_for(
    options: SaveOptions, asynchronous: bool, buffers: HostBuffers | None = None
) -> TorchAdapter:
    """The adapter of one save: asynchronous saves copy into reused host buffers (`buffers`,
    else the pool of the manager starting the save, else the process's)."""
    if asynchronous and buffers is None:
        buffers = current_pool(HostBuffers) or _buffers
    return TorchAdapter(buffers if asynchronous else None, options.trees_differ)


def save(
    directory: Location | Storage,
    state_dict: Any,
    options: SaveOptions = SaveOptions(),
    *,
    overwrite: bool = False,
    coordinator: Any = None,
    base: Location | Storage | None = None,
) -> _saving.SaveTimings:
    """Save a torch state dict atomically; every rank calls it with its own state dict of
    the same structure, or with `SaveOptions(trees_differ=True)` one whose keys differ by
    rank (pipeline stages: the checkpoint holds their union). Leaves: tensors (taken to be
    equal on every rank that has them), DTensors (each rank writes only the boxes the
    shared plan gives it), NumPy arrays, Python values.
    `options`, `overwrite` and `base` as in snapshard.save (an existing empty directory
    is written into)."""
    return _saving.save_through(
        adapter_for(options, False), directory, state_dict, options, overwrite=overwrite,
        coordinator=coordinator or default_coordinator(), base=base,
    )  # fmt: skip


# One AsyncSave serves both wings: the adapter gives its host buffers back when it ends.
AsyncSave = _saving.AsyncSave


def save_async(
    directory: Location | Storage,
    state_dict: Any,
    options: SaveOptions = SaveOptions(),
    *,
    overwrite: bool = False,
    coordinator: Any = None,
    base: Location | Storage | None = None,
    extra: dict[str, Any] | None = None,
) -> AsyncSave:
    """Start a save; returns once every byte this rank writes is copied to host memory, so
    the caller may step the optimizer at once. `wait()` returns the timings or raises."""
    prep = _saving.prepare(
        directory, state_dict, options, overwrite=overwrite,
        coordinator=coordinator or default_coordinator(), asynchronous=True,
        adapter=adapter_for(options, True), base=base, extra=extra,
    )  # fmt: skip
    return AsyncSave(prep)
