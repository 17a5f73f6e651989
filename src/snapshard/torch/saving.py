"""Saving torch state dicts through snapshard's save executor.

The blocking phase stages this rank's planned boxes on the host:

- synchronous saves on CPU: NumPy views of the tensors' memory (the caller waits for the
  whole save, so nothing can change underneath; no copy);
- asynchronous saves (and any CUDA tensor): every owned byte is copied into host buffers
  before returning, since ``optimizer.step()`` updates tensors in place. Buffers are reused
  from one save to the next (pinned memory for CUDA sources, which are copied with
  ``non_blocking`` on a side stream that is synchronised before returning).

Writing, reporting, merging, validating and committing are snapshard's own (saving.finish).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from .. import saving as _saving
from ..adapters.leaves import SaveArray
from ..background import BackgroundTask
from ..format.manifest import Leaf
from ..gc_pause import collection_paused
from ..manager.framework import StartedSave
from ..options import SaveOptions
from ..planning import WritePlan
from ..read_executor import aligned_empty
from ..staging import StagedItem, planned_items
from ..storage import Location, Storage, storage_for
from ..tree import Path
from . import leaves as _leaves
from .coordination import default_coordinator
from .dtypes import host_view


class HostBuffers:
    """Host buffers reused across asynchronous saves, by byte size.

    A save takes the buffers it needs and gives them all back when its background phase
    ends; buffers no save asked for in a round are dropped, so memory stays at what the
    saves in flight need."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[tuple[np.ndarray, torch.Tensor | None]]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int, pinned: bool) -> tuple[np.ndarray, torch.Tensor | None]:
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                return free.pop()
        if pinned:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            return t.numpy(), t
        return aligned_empty(nbytes), None

    def give_back(self, bufs: list[tuple[np.ndarray, torch.Tensor | None]]) -> None:
        fresh: dict[tuple[int, bool], list[tuple[np.ndarray, torch.Tensor | None]]] = {}
        for b in bufs:
            fresh.setdefault((b[0].nbytes, b[1] is not None), []).append(b)
        with self._lock:
            self._free = fresh

    def cached_bytes(self) -> int:
        with self._lock:
            return sum(b[0].nbytes for v in self._free.values() for b in v)


_buffers = HostBuffers()


class TorchAdapter:
    """snapshard.saving.SaveAdapter for torch state dicts."""

    def __init__(self, buffers: HostBuffers | None) -> None:
        self.buffers = buffers
        self.taken: list[tuple[np.ndarray, torch.Tensor | None]] = []

    def is_leaf(self, x: Any) -> bool:
        return _leaves.is_leaf(x)

    def classify(self, path: Path, value: Any, process_count: int) -> Leaf | SaveArray:
        return _leaves.classify(path, value, process_count)

    def _buffer(self, nbytes: int, pinned: bool) -> tuple[np.ndarray, torch.Tensor | None]:
        if self.buffers is None:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pinned else None
            return (t.numpy(), t) if t is not None else (aligned_empty(nbytes), None)
        b = self.buffers.take(nbytes, pinned)
        self.taken.append(b)
        return b

    def stage(
        self, arrays: list[tuple[int, SaveArray]], plan: WritePlan, process: int, *, copy: bool
    ) -> tuple[list[StagedItem], int]:
        items: list[StagedItem] = []
        used = 0
        streams: dict[torch.device, Any] = {}
        for item, _, arr, row in planned_items(arrays, plan, process):
            items.append(item)
            rel = _leaves.row_slices(arr, row, item.start, item.stop)
            src = arr.source
            if isinstance(src, _leaves.TorchSource):
                local = src.local[rel] if rel else src.local
                if local.device.type != "cpu":
                    item.host = self._to_pinned(local, item.nbytes, arr.dtype, streams)
                    used += item.nbytes
                    continue
                view = host_view(local)
            else:  # a NumPy leaf
                view = np.asarray(src)[rel]
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
    saving.prepare).

    Asynchronous (the default): every byte this rank writes is copied into host buffers
    (from `buffers`, the process's pool by default) before returning, whatever
    `options.host_budget` says, and the buffers go back to the pool when the background
    phase, `finish()`, ends, however it ends. Synchronous: CPU tensors are staged as views
    of their memory, so the caller must not change them before `finish()` returns.
    `snapshot` is taken for the manager's sake and unused."""
    del snapshot
    adapter = TorchAdapter((buffers or _buffers) if asynchronous else None)
    prep = _saving.prepare(
        directory,
        state_dict,
        options,
        coordinator=coordinator or default_coordinator(),
        asynchronous=asynchronous,
        adapter=adapter,
        **prepare_args,
    )

    def finish() -> _saving.SaveTimings:
        try:
            return _saving.finish(prep)
        finally:
            if adapter.buffers is not None:
                adapter.buffers.give_back(adapter.taken)

    return StartedSave(prep.timings, finish)


@collection_paused()
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
    the same structure. Leaves: tensors (taken to be equal on every rank), DTensors (each
    rank writes only the boxes the shared plan gives it), NumPy arrays, Python values.
    `options`, `overwrite` and `base` as in snapshard.save."""
    storage = storage_for(directory)
    _saving.refuse_existing(storage, overwrite)
    started = start_save(
        storage, state_dict, options, asynchronous=False, overwrite=overwrite,
        coordinator=coordinator, base=base,
    )  # fmt: skip
    return started.finish()


class AsyncSave(_saving.AsyncSave):
    """A torch save whose background phase runs: `wait()` returns its timings or raises.
    Its host buffers go back for reuse when it ends (whether it succeeded or not)."""

    def __init__(self, started: StartedSave, url: str):
        self._started = started
        self._url = url
        BackgroundTask.__init__(self, started.finish, f"save to {url}")

    @property
    def location(self) -> str:
        return self._url

    @property
    def timings(self) -> _saving.SaveTimings:
        return self._started.timings


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
    storage = storage_for(directory)
    started = start_save(
        storage, state_dict, options, overwrite=overwrite, coordinator=coordinator,
        base=base, extra=extra,
    )  # fmt: skip
    return AsyncSave(started, storage.url)
