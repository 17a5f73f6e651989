"""Reshards read once for torch: each rank reads a band of whole rows of a target that cuts
the saved rows, and one all-to-all over torch.distributed moves the bands into the target
shards (planning/exchange.py says when and why).

Call order, on every rank, with the same target:

1. `plan(targets, saved, rank, world, devices, saved_boxes)`: pure, no communication. A
   target leaf qualifies when it is a DTensor (or a tensor) whose boxes each live on one
   rank, the group can move CPU tensors (gloo), its saved boxes are known and its boxes
   cut their rows (`cuts_rows`).
2. `batches_of(leaves, memory_budget)`: batches cut alike on every rank, from the most
   host bytes any rank holds for a leaf (its band, what it sends and what it receives).
3. `exchange(batch, regions, read, rv, step, error)` per batch: read this rank's bands;
   agree through the rendezvous that every rank's reads (and every earlier step)
   succeeded, so that a failure fails every rank, naming it, instead of a rank waiting in
   a collective; then pack, `all_to_all_single`, and unpack into the target regions, cast
   to their dtypes. Returns the bytes received from peers.

The bytes travel in the saved dtype, through CPU buffers, whatever device the target is
on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..coordination.rendezvous import Rendezvous, all_succeeded
from ..dtypes import dtype_from_name
from ..format import ArrayLeaf
from ..planning.exchange import Messages, cuts_rows, messages, row_bands
from ..read_executor import Dest, ReadDests, SavedBoxes, aligned_empty, batches
from .leaves import dtensor_layout, is_dtensor

Box = tuple[tuple[int, ...], tuple[int, ...]]
# Stores a piece (NumPy, the saved dtype) into a view of a target region.
Store = Callable[[Any, np.ndarray], None]


@dataclass(frozen=True)
class BandLeaf:
    """One target leaf read as bands: the saved leaf, every rank's band, the target's boxes
    (box i held by rank holders[i]) and the messages between them."""

    leaf: int  # index among the load's target leaves
    saved: ArrayLeaf
    band_starts: np.ndarray  # (world, ndim)
    band_stops: np.ndarray
    box_starts: np.ndarray  # (boxes, ndim)
    box_stops: np.ndarray
    msgs: Messages

    @property
    def itemsize(self) -> int:
        return dtype_from_name(self.saved.dtype).itemsize

    def band(self, rank: int) -> Box:
        return _box(self.band_starts[rank], self.band_stops[rank])

    def cost(self) -> int:
        """The most host bytes one rank holds for this leaf: band, sends and receives."""
        world = len(self.band_starts)
        band = np.prod(self.band_stops - self.band_starts, axis=1, dtype=np.int64)
        moved = self.msgs.elements * (self.msgs.sender != self.msgs.receiver)
        sent = np.bincount(self.msgs.sender, moved, minlength=world)
        received = np.bincount(self.msgs.receiver, moved, minlength=world)
        return int((band + sent + received).max(initial=0)) * self.itemsize


def _box(start: Any, stop: Any) -> Box:
    return tuple(int(x) for x in start), tuple(int(x) for x in stop)


def plan(
    targets: Sequence[Any],
    saved: Sequence[ArrayLeaf | None],
    world: int,
    devices: frozenset[str],
    saved_boxes: SavedBoxes,
) -> list[BandLeaf]:
    """Step 1: the target leaves read as bands (saved[i] None: leaf i is read as usual)."""
    if "cpu" not in devices or world < 2:
        return []
    out = []
    for i, (t, leaf) in enumerate(zip(targets, saved, strict=True)):
        if leaf is None or not isinstance(t, torch.Tensor) or not is_dtensor(t) or t.ndim < 2:
            continue
        lay = dtensor_layout(t, 1).layout
        if lay.nbytes == 0 or np.any(lay.shards.num_candidates > 1):
            continue  # replicated boxes are broadcast (torch/read_once.py)
        boxes = saved_boxes(leaf)
        if boxes is None or not cuts_rows(*boxes, lay.starts, lay.stops):
            continue
        band_starts, band_stops = row_bands(lay.shape, world)
        msgs = messages(band_starts, band_stops, lay.starts, lay.stops, lay.process_ids)
        out.append(BandLeaf(i, leaf, band_starts, band_stops, lay.starts, lay.stops, msgs))
    return out


def batches_of(leaves: list[BandLeaf], memory_budget: int | None) -> list[list[BandLeaf]]:
    """Step 2."""
    costs = {b.leaf: b.cost() for b in leaves}
    return batches(leaves, lambda b: costs[b.leaf], memory_budget)


def _slices(start: np.ndarray, stop: np.ndarray, origin: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(int(a) - o, int(b) - o) for a, b, o in zip(start, stop, origin, strict=True))


def exchange(
    batch: list[BandLeaf],
    regions: dict[tuple[int, Box], Any],
    read: ReadDests,
    store: Store,
    rv: Rendezvous,
    step: str,
    error: BaseException | None,
) -> int:
    """Step 3 for one batch; `regions` maps (target leaf, box) to the view of the target that
    this rank's box is. Raises on every rank if any rank's reads failed."""
    rank, world = rv.coord.process_index, rv.coord.process_count
    bands: dict[int, np.ndarray] = {}
    dests = []
    for b in batch:
        start, stop = b.band(rank)
        shape = tuple(e - s for s, e in zip(start, stop, strict=True))
        dt = dtype_from_name(b.saved.dtype)
        buf = aligned_empty(math.prod(shape) * dt.itemsize)
        bands[b.leaf] = buf.view(dt).reshape(shape)
        if buf.nbytes:
            dests.append(Dest(b.saved, np.asarray(start), np.asarray(stop), buf))
    if error is None:
        try:
            read(dests)
        except Exception as e:
            error = e
    all_succeeded(rv, step, error)

    def pieces(sender: int | None, receiver: int | None) -> list[tuple[BandLeaf, int]]:
        return [(b, int(m)) for b in batch for m in b.msgs.between(sender, receiver)]

    def nbytes(b: BandLeaf, m: int) -> int:
        return int(b.msgs.elements[m]) * b.itemsize

    def target(b: BandLeaf, m: int) -> Any:
        box = int(b.msgs.box[m])
        view = regions[(b.leaf, _box(b.box_starts[box], b.box_stops[box]))]
        return view[_slices(b.msgs.start[m], b.msgs.stop[m], b.box_starts[box].tolist())]

    def band_piece(b: BandLeaf, m: int) -> np.ndarray:
        origin = b.band_starts[rank].tolist()
        return bands[b.leaf][_slices(b.msgs.start[m], b.msgs.stop[m], origin)]

    for b, m in pieces(rank, rank):  # this rank's own part of its band
        store(target(b, m), band_piece(b, m))
    sends = [pieces(rank, q) if q != rank else [] for q in range(world)]
    recvs = [pieces(p, rank) if p != rank else [] for p in range(world)]
    send_sizes = [sum(nbytes(*pm) for pm in s) for s in sends]
    recv_sizes = [sum(nbytes(*pm) for pm in r) for r in recvs]
    send = np.empty(sum(send_sizes), np.uint8)
    at = 0
    for s in sends:
        for b, m in s:
            n = nbytes(b, m)
            piece = band_piece(b, m)
            np.copyto(send[at : at + n].view(piece.dtype).reshape(piece.shape), piece)
            at += n
    bands.clear()
    recv = np.empty(sum(recv_sizes), np.uint8)
    torch.distributed.all_to_all_single(
        torch.from_numpy(recv), torch.from_numpy(send), recv_sizes, send_sizes
    )
    del send
    at = 0
    for r in recvs:
        for b, m in r:
            n = nbytes(b, m)
            shape = tuple(int(x) for x in b.msgs.stop[m] - b.msgs.start[m])
            dt = dtype_from_name(b.saved.dtype)
            store(target(b, m), recv[at : at + n].view(dt).reshape(shape))
            at += n
    return int(recv.nbytes)
