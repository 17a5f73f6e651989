"""Which target leaves a load reads as bands of whole rows, in which exchanges and batches
(torch/exchange.py moves them; planning/exchange.py says when and why). Pure, no
communication: every rank plans alike from the same target and the same `memory_budget`.

1. `plan(targets, saved, world, devices, saved_boxes, memory_budget)`: a target leaf
   qualifies when it is a DTensor of two or more dimensions, the group can move CPU
   tensors (gloo), its saved boxes are known and its boxes cut their rows (`cuts_rows`). A
   box several ranks hold (a Replicate dimension) is sent to each of them; replicated
   targets that do not cut the rows are left to torch/read_once.py, which reads each box
   once and broadcasts it. A large leaf is cut into slabs of rows, one exchange each.
2. `batches_of(exchanges, memory_budget, shared)`: batches cut alike on every rank, from
   the most host bytes any rank holds for an exchange (its band, what it sends and
   receives; through shared memory, two slots of its band).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ..dtypes import dtype_from_name
from ..format import ArrayLeaf, checksum_block
from ..planning import ArrayLayout
from ..planning.exchange import (
    Align,
    Messages,
    block_aligned,
    cuts_rows,
    messages,
    row_bands,
    slabs,
)
from ..planning.layout import Box
from ..planning.read_once import as_box
from ..reading import SavedBoxes, batches
from .leaves import dtensor_layout
from .values import is_dtensor

# The most host bytes one rank holds for one exchange of a leaf (its band, what it sends
# and receives): larger leaves move in slabs of rows (planning.exchange.slabs), through
# buffers reused from step to step (fresh memory costs a page fault per page).
STEP_BYTES = 64 << 20


@dataclass(frozen=True)
class BandLeaf:
    """One exchange of a target leaf read as bands: the saved leaf, every rank's band (or
    one slab of it), the target's boxes and the messages between them."""

    leaf: int  # index among the load's target leaves
    saved: ArrayLeaf
    band_starts: np.ndarray  # (world, ndim)
    band_stops: np.ndarray
    box_starts: np.ndarray  # (boxes, ndim)
    box_stops: np.ndarray
    msgs: Messages

    @cached_property
    def dtype(self) -> np.dtype:
        return dtype_from_name(self.saved.dtype)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def moves(self) -> bool:
        """Whether any piece goes from one rank to another."""
        return bool(np.any(self.msgs.sender != self.msgs.receiver))

    def band(self, rank: int) -> Box:
        return as_box(self.band_starts[rank], self.band_stops[rank])

    def piece_shape(self, m: int) -> tuple[int, ...]:
        return tuple(int(x) for x in self.msgs.stop[m] - self.msgs.start[m])

    def piece_bytes(self, m: int) -> int:
        return int(self.msgs.elements[m]) * self.itemsize

    def band_piece(self, band: np.ndarray, rank: int, m: int) -> np.ndarray:
        """Piece `m` in this rank's band."""
        return band[_slices(self.msgs, m, self.band_starts[rank])]

    def target_view(self, regions: dict[tuple[int, Box], Any], m: int) -> Any:
        """Piece `m` in the view of the target box it belongs to."""
        t = int(self.msgs.target[m])
        view = regions[(self.leaf, as_box(self.box_starts[t], self.box_stops[t]))]
        return view[_slices(self.msgs, m, self.box_starts[t])]

    @cached_property
    def _band_elements(self) -> np.ndarray:
        """Elements of every rank's band."""
        return np.prod(self.band_stops - self.band_starts, axis=1, dtype=np.int64)

    def cost(self) -> int:
        """The most host bytes one rank holds for this leaf: band, sends and receives."""
        world = len(self.band_starts)
        band = self._band_elements
        moved = self.msgs.elements * (self.msgs.sender != self.msgs.receiver)
        sent = np.bincount(self.msgs.sender, moved, minlength=world)
        received = np.bincount(self.msgs.receiver, moved, minlength=world)
        return int((band + sent + received).max(initial=0)) * self.itemsize

    def shared_cost(self) -> int:
        """The same through shared memory: two slots of the largest band (SharedBands)."""
        return 2 * int(self._band_elements.max(initial=0)) * self.itemsize


def plan(
    targets: Sequence[Any],
    saved: Sequence[ArrayLeaf | None],
    world: int,
    devices: frozenset[str],
    saved_boxes: SavedBoxes,
    memory_budget: int | None = None,
) -> list[BandLeaf]:
    """Step 1: the target leaves read as bands (saved[i] None: leaf i is read as usual), a
    leaf in as many slabs of rows as keep each exchange within STEP_BYTES and
    `memory_budget` per rank."""
    step_bytes = _step_bytes(memory_budget)
    if "cpu" not in devices or world < 2:
        return []
    out = []
    cuts = Cuts(saved_boxes)
    for i, (t, leaf) in enumerate(zip(targets, saved, strict=True)):
        got = cuts.banded(t, leaf)
        if got is None or leaf is None:
            continue
        lay, boxes = got
        align = _block_aligner(*boxes, leaf)
        whole = row_bands(lay.shape, world, align)
        steps = 1
        while True:
            parts = [whole] if steps == 1 else slabs(*whole, steps, align)
            cut = [
                BandLeaf(i, leaf, bs, be, lay.starts, lay.stops,
                         messages(bs, be, lay.starts, lay.stops, lay.process_ids))
                for bs, be in parts
            ]  # fmt: skip
            most = max(b.cost() for b in cut)
            if most <= step_bytes or steps >= lay.shape[0]:
                break
            steps = min(lay.shape[0], steps * -(-most // step_bytes))
        out += cut
    return out


class Cuts:
    """Whether target leaves are read as bands (step 1's test), remembered per target layout
    and saved boxes: the leaves of a state repeat a few layouts, and the test costs tens of
    microseconds a leaf."""

    def __init__(self, saved_boxes: SavedBoxes) -> None:
        self.saved_boxes = saved_boxes
        self._seen: dict[tuple[int, bytes, bytes], bool] = {}
        self._keep: list[Any] = []  # the layouts keyed by id, alive while this lives

    def banded(
        self, target: Any, leaf: ArrayLeaf | None
    ) -> tuple[ArrayLayout, tuple[np.ndarray, np.ndarray]] | None:
        """(the target's layout, the saved boxes) where the target leaf is read as bands."""
        if leaf is None or not isinstance(target, torch.Tensor) or not is_dtensor(target):
            return None
        if target.ndim < 2:
            return None
        lay = dtensor_layout(target, 1).layout  # one row per rank: a replicated box on each holder
        if lay.nbytes == 0:
            return None
        boxes = self.saved_boxes(leaf)
        if boxes is None:
            return None
        key = (id(lay), boxes[0].tobytes(), boxes[1].tobytes())
        cut = self._seen.get(key)
        if cut is None:
            cut = self._seen[key] = cuts_rows(*boxes, lay.starts, lay.stops)
            self._keep.append(lay)
        return (lay, boxes) if cut else None


def _block_aligner(starts: np.ndarray, stops: np.ndarray, leaf: ArrayLeaf) -> Align:
    """Band and slab cuts moved onto the checksum blocks of the saved boxes, taken as the
    chunks they were written as, with the blocks a snapshard save makes (format.
    checksum_block of a chunk's bytes). Where a save cut a box into several chunks
    (replicas writing parts of it) or the source has no such blocks, a cut may miss a
    block: that costs a block read twice, never a wrong byte."""
    itemsize = dtype_from_name(leaf.dtype).itemsize
    sizes = np.prod(stops - starts, axis=1, dtype=np.int64) * itemsize
    block = np.array([checksum_block(int(n)) for n in sizes], np.int64)
    return lambda rows, fixed: block_aligned(rows, fixed, starts, stops, itemsize, block)


def _step_bytes(memory_budget: int | None) -> int:
    return STEP_BYTES if memory_budget is None else max(1, min(memory_budget, STEP_BYTES))


def batches_of(
    leaves: list[BandLeaf], memory_budget: int | None, shared: bool = False
) -> list[list[BandLeaf]]:
    """Step 2: batches of at most STEP_BYTES (and `memory_budget`) per rank, through the
    collective or (`shared`) through shared memory."""
    costs = [b.shared_cost() if shared else b.cost() for b in leaves]
    cut = batches(list(range(len(leaves))), costs.__getitem__, _step_bytes(memory_budget))
    return [[leaves[i] for i in group] for group in cut]


def _slices(msgs: Messages, m: int, origin: np.ndarray) -> tuple[slice, ...]:
    """Piece `m` as slices of an array whose first element is at `origin`."""
    lo, hi = (msgs.start[m] - origin).tolist(), (msgs.stop[m] - origin).tolist()
    return tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
