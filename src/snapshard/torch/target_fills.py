"""The reads that fill a torch target leaf on this rank, each a `Fill` (reading/fills.py): a
DTensor's local shard (its boxes computed from its own mesh and placements, whatever mesh
the checkpoint was saved from), a plain tensor or NumPy array whole. Where a target region
is one contiguous CPU block of the saved dtype, the reads land in the tensor's memory
directly; otherwise they go through a host buffer, are cast if the dtypes differ, and are
copied in (`store`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..dtypes import dtype_from_name
from ..format import ArrayLeaf
from ..reading import Dest, aligned_empty
from .dtypes import from_numpy, host_view, numpy_dtype
from .leaves import dtensor_layout
from .values import is_dtensor, local_tensor


class TargetFill:
    """One region of a target leaf, a `Fill` (reading/fills.py): read into the region's own
    memory (`direct`, a uint8 view of it), or into a staging buffer made for the batch that
    reads it and dropped once `finish` has cast (and transposed) it into the region. Staging is
    made per batch so that `ReadOptions.memory_budget` bounds the host bytes held at once.
    `start`, `stop`: the region's box in the target's coordinates; `saved_start`,
    `saved_stop`: the box of the saved array it is read from."""

    def __init__(
        self,
        leaf: ArrayLeaf,
        saved: tuple[np.ndarray, np.ndarray],
        start: np.ndarray,
        stop: np.ndarray,
        region: Any,
        direct: np.ndarray | None,
        perm: tuple[int, ...] | None,
    ):
        self.leaf, (self.saved_start, self.saved_stop) = leaf, saved
        self.start, self.stop, self.region = start, stop, region
        self.direct, self.perm = direct, perm
        self._staged: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The saved box's shape."""
        return tuple(int(b - a) for a, b in zip(self.saved_start, self.saved_stop, strict=True))

    @property
    def buffered(self) -> int:
        """The staging bytes this fill needs while its batch is read."""
        if self.direct is not None:
            return 0
        return math.prod(self.shape) * dtype_from_name(self.leaf.dtype).itemsize

    def dests(self) -> list[Dest]:
        """Where the read lands: the region itself, or a staging buffer made now."""
        buf = self.direct
        if buf is None:
            buf = self._staged = aligned_empty(self.buffered)
        return [Dest(self.leaf, self.saved_start, self.saved_stop, buf)]

    def finish(self) -> None:
        """Move a staged read into the region, cast to its dtype, and drop the staging."""
        if self._staged is None:
            return
        data = self._staged.view(dtype_from_name(self.leaf.dtype)).reshape(self.shape)
        store(self.region, data if self.perm is None else data.transpose(self.perm))
        self._staged = None


def _regions(target: Any, rank: int) -> list[tuple[np.ndarray, np.ndarray, Any]]:
    """(global start, stop, view of the target) of every region of some elements rank
    `rank` holds."""
    if isinstance(target, torch.Tensor) and is_dtensor(target):
        local = local_tensor(target)
        return [
            (s, e, local if slc is None else local[slc])
            for s, e, slc in dtensor_layout(target, 1).boxes_of(rank)
        ]
    if 0 in target.shape:
        return []
    nd = len(target.shape)
    return [(np.zeros(nd, np.int64), np.asarray(target.shape, dtype=np.int64), target)]


def fills_of(
    leaf: ArrayLeaf, target: Any, rank: int, perm: tuple[int, ...] | None = None
) -> list[TargetFill]:
    """The reads that fill rank `rank`'s part of `target` from `leaf`; with `perm`, the
    target is the saved array transposed by it (target axis i is saved axis perm[i])."""
    saved_dt = dtype_from_name(leaf.dtype)
    out = []
    for target_start, target_stop, region in _regions(target, rank):
        start, stop = target_start, target_stop
        if perm is not None:  # the box of the saved array that holds this region
            inv = np.argsort(perm)
            start, stop = start[inv], stop[inv]
        if isinstance(region, torch.Tensor):
            want = numpy_dtype(region.dtype, leaf=leaf.name)
            direct = region.device.type == "cpu" and region.is_contiguous() and want == saved_dt
        else:
            want = region.dtype
            direct = region.flags.c_contiguous and want == saved_dt and region.flags.writeable
        flat = None
        if direct and perm is None:
            flat = host_view(region) if isinstance(region, torch.Tensor) else region
            flat = flat.reshape(-1).view(np.uint8)
        out.append(TargetFill(leaf, (start, stop), target_start, target_stop, region, flat, perm))
    return out


def store(region: Any, data: np.ndarray) -> None:
    """Copy `data` (NumPy) into a target region (a tensor view or a NumPy array), cast to
    the region's dtype."""
    want = region.dtype if isinstance(region, np.ndarray) else numpy_dtype(region.dtype)
    if data.dtype != want:
        data = data.astype(want)
    if isinstance(region, np.ndarray):
        np.copyto(region, data)
    elif region.device.type == "cpu":
        np.copyto(host_view(region), data)
    else:
        t = from_numpy(np.require(data, requirements=["C", "W"]))  # (peers' memory is read-only)
        assert t is not None
        region.copy_(t)
