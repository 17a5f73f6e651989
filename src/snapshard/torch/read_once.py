"""Read-once restores for torch, for `snapshard.torch.load` and for `dcp.load` through
snapshard.torch.StorageReader: a box that several ranks hold is read from storage by one of
them and broadcast to the others over torch.distributed. Two plans, both made by the pure
planner (planning/read_once.py), one broadcast.

`snapshard.torch.load`, on every rank, with the same target:

1. `plan(targets, rank, world, devices)`: pure, no communication. The layouts of the target
   tensors on devices the default process group serves (a DTensor's from its mesh and
   placements, a plain tensor held whole by every rank) go to `plan_holders`.
2. `ReadOncePlan.bind(leaf, fills)` for every target leaf: the fills this rank reads itself;
   the regions of the others come from a peer.
3. The restore reads those fills.
4. `ReadOncePlan.share(rendezvous, error)`: `broadcast` below.

`dcp.load` (the reader's methods in brackets):

1. Every rank (`prepare_local_plan`): whether it wants read-once (`wanted_here`, as above)
   and whether it has a device to broadcast on (`broadcast_device`); both go to the
   coordinator with its local plan.
2. The coordinator (`prepare_global_plan`): `plan_dcp(keys, nbytes)` over the boxes that
   several ranks' plans read alike (the same tensor, the same saved offsets and lengths).
   The same `DcpReadOncePlan` goes into every rank's plan, or none when a rank did not
   want read-once or no box is shared.
3. Every rank (`read_data`): reads its own items and those shared boxes it was given, then
   `share_dcp`: `broadcast` below.

`broadcast`: every rank reports whether its reads succeeded (one rendezvous through the
coordinator's store, bounded by its timeout): a failed read fails every rank, naming the
rank. Then, for every box held by several ranks, in one order on every rank, its reader
broadcasts the box to the group of its holders. The groups are made for the broadcasts, in
the same order on every rank, and destroyed after them, so that no group (and none of its
backend's threads) outlives the restore. A failure during the broadcasts themselves is
bounded by the process group's timeout, not the rendezvous's.

Read-once is the default where `ReadOptions.read_once` says so (read_once_policy: object
stores, network filesystems); NumPy targets, and tensors on devices the default group has
no backend for (CPU tensors under an NCCL-only group), are always read by each rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from ..coordination.rendezvous import Rendezvous, all_succeeded
from ..errors import SnapshardError
from ..planning import ArrayLayout
from ..planning.layout import Box, host_layout
from ..planning.read_once import BoxKey, DcpReadOncePlan, SharedBox, as_box, plan_holders
from .leaves import dtensor_layout
from .values import is_dtensor


class Region(Protocol):
    """A region of a target leaf (torch/target_fills.py): its box in the target's
    coordinates and its view of the target."""

    start: Any
    stop: Any
    region: Any


R = TypeVar("R", bound=Region)


@dataclass
class ReadOncePlan:
    """Which boxes this rank reads and which it receives (see the module docstring)."""

    rank: int
    leaves: frozenset[int]  # the target leaves planned (torch tensors)
    # (leaf, box) this rank reads from storage; the boxes it holds that are missing here
    # come from a peer.
    reads: set[tuple[int, Box]]
    shared: list[SharedBox]  # every box with several holders, in the one order of all ranks
    _regions: dict[tuple[int, Box], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._shared_keys = {(s.leaf, s.box) for s in self.shared}

    def bind(self, leaf: int, fills: Sequence[R]) -> list[R]:
        """The fills of target leaf `leaf` that this rank reads itself; the regions of the
        others are remembered, to be received in `share`."""
        if leaf not in self.leaves:
            return list(fills)
        out = []
        for f in fills:
            key = (leaf, as_box(f.start, f.stop))
            self._regions[key] = f.region
            if key in self.reads:
                out.append(f)
            elif key not in self._shared_keys:
                raise SnapshardError(
                    f"read-once: box {key[1]} of target leaf {leaf} is not planned"
                )
        return out

    def share(self, rv: Rendezvous, error: BaseException | None) -> int:
        """Step 4 (agreement, then broadcasts); returns the bytes this rank received."""
        boxes = [
            (s.reader, s.holders, [region])
            for s in self.shared
            if (region := self._regions.get((s.leaf, s.box))) is not None  # (a holder's)
        ]
        holder_sets = sorted({s.holders for s in self.shared})
        return broadcast(holder_sets, boxes, self.rank, rv, error, None)


def broadcast(
    holder_sets: list[tuple[int, ...]],
    boxes: Iterable[tuple[int, tuple[int, ...], list[torch.Tensor]]],
    rank: int,
    rv: Rendezvous,
    error: BaseException | None,
    device: torch.device | None,
) -> int:
    """After the reads: agreement, then the broadcasts (see the module docstring).
    `holder_sets`: those of every shared box of the plan, in the plan's order (the groups
    are made collectively from them); `boxes`: (reader, holders, target regions) of each
    shared box this rank holds, in the plan's order, the regions filled where this rank
    read them. Boxes travel on `device` (None: their first region's own). Returns the
    bytes this rank received."""
    all_succeeded(rv, "read", error)
    groups = _holder_groups(holder_sets, rv.coord.process_count)
    received = 0
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
    try:
        for reader, holders, targets in boxes:
            first = targets[0]
            on = device if device is not None else first.device
            direct = first.device == on and first.is_contiguous() and len(targets) == 1
            buf = first if direct else torch.empty(first.shape, dtype=first.dtype, device=on)
            if reader == rank and not direct:
                buf.copy_(first)
            # bytes, whatever the dtype (float8, bool...); the planners kept only devices
            # the group has a backend for
            work = torch.distributed.broadcast(
                buf.reshape(-1).view(torch.uint8), src=reader, group=groups[holders],
                async_op=True,
            )  # fmt: skip
            pending.append((work, buf, targets if reader != rank else []))
            if reader != rank:
                received += buf.numel() * buf.element_size()
        for work, buf, targets in pending:
            work.wait()
            for t in targets:
                if t is not buf:
                    t.copy_(buf)
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # (NCCL's wait only orders the stream: done before the end)
        for group in groups.values():
            if group is not None:
                torch.distributed.destroy_process_group(group)
    return received


def _holder_groups(holder_sets: list[tuple[int, ...]], world: int) -> dict[tuple[int, ...], Any]:
    """The process group of each holder set (None: the default group), made collectively,
    in the same sorted order on every rank."""
    return {
        ranks: None if len(ranks) == world else torch.distributed.new_group(list(ranks))
        for ranks in holder_sets
    }


def backend_devices() -> frozenset[str]:
    """The device types the default process group has a backend for ('cpu:gloo,cuda:nccl'
    serves both; a plain 'nccl' group CUDA only)."""
    config = torch.distributed.get_backend_config()
    return frozenset(part.split(":")[0] for part in config.split(",") if ":" in part)


def target_layout(target: Any, world: int, devices: frozenset[str]) -> ArrayLayout | None:
    """The layout of a torch target leaf over the ranks; None for what is never shared."""
    if not isinstance(target, torch.Tensor) or target.device.type not in devices:
        return None
    if is_dtensor(target):
        return dtensor_layout(target, target.element_size()).layout
    return host_layout(tuple(int(s) for s in target.shape), target.element_size(), world)


def has_shared(layout: ArrayLayout | None) -> bool:
    """Whether a layout has a box of some bytes that several ranks hold (what `plan` would
    share), as cheaply as it can be told."""
    if layout is None or layout.nbytes == 0:
        return False
    g = layout.shards
    return bool(np.any((g.num_candidates > 1) & (g.nbytes > 0)))


def any_shared(targets: Sequence[Any], world: int, devices: frozenset[str]) -> bool:
    """Whether `plan` over these targets would share a box: the first target that has one
    answers, each layout is tested once."""
    seen: dict[int, bool] = {}
    keep = []  # the layouts keyed by id, alive until the end
    for t in targets:
        la = target_layout(t, world, devices)
        if la is None:
            continue
        hit = seen.get(id(la))
        if hit is None:
            hit = seen[id(la)] = has_shared(la)
            keep.append(la)
        if hit:
            return True
    return False


def plan(targets: list[Any], rank: int, world: int, devices: frozenset[str]) -> ReadOncePlan | None:
    """Step 1 for the target leaves; None when no box of them has several holders."""
    return plan_layouts([target_layout(t, world, devices) for t in targets], rank, world)


def plan_layouts(layouts: list[ArrayLayout | None], rank: int, world: int) -> ReadOncePlan | None:
    """Step 1 from the leaves' layouts (None: a leaf every rank reads itself)."""
    found = plan_holders(layouts, rank, world)
    return None if found is None else ReadOncePlan(rank, *found)


def broadcast_device(devices: frozenset[str]) -> torch.device | None:
    """The device shared boxes travel on, the same on every rank of one group (a job's
    ranks all have CUDA or none has)."""
    if "cuda" in devices and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "cpu" in devices:
        return torch.device("cpu")
    return None


def share_dcp(
    once: DcpReadOncePlan,
    rank: int,
    regions: dict[BoxKey, list[torch.Tensor]],
    rv: Rendezvous,
    error: BaseException | None,
    device: torch.device,
) -> int:
    """dcp.load's step 3 after the reads: `broadcast`. `regions`: the target regions of
    this rank's shared boxes (filled where this rank read them). Returns the bytes this
    rank received."""
    boxes = [
        (s.reader, s.holders, regions[s.key])
        for s in once.shared
        if rank in s.holders and regions.get(s.key)
    ]
    return broadcast(once.holders_of(), boxes, rank, rv, error, device)
