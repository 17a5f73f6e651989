"""Read-once for `dcp.load` through snapshard.torch.StorageReader: a saved box that the load
plans of several ranks read (a replicated tensor, or the same shard on every data-parallel
replica) is read from storage by one of them and broadcast to the others.

Call order (DCP's, the reader's methods in brackets):

1. Every rank (`prepare_local_plan`): whether it wants read-once (`wanted`, as
   snapshard.torch.load decides: `ReadOptions.read_once`, by default object stores and
   network filesystems), and the collectives it can broadcast on; both go to the coordinator
   with its local plan.
2. The coordinator (`prepare_global_plan`): `plan(keys, nbytes)`, pure: the boxes that
   several ranks' plans read alike (the same tensor, the same saved offsets and lengths),
   each given to the holder with the fewest bytes to read so far (largest boxes first), in
   one order. The same `ReadOncePlan` goes into every rank's plan, or none when a rank did
   not want read-once or no box is shared.
3. Every rank (`read_data`): reads its own items and those shared boxes it was given;
   `share`: every rank reports whether its reads succeeded (a failed read fails every rank,
   naming it), then, in the plan's order, each shared box's reader broadcasts it to the
   group of its holders. Broadcasts go through CUDA where there is CUDA and the default
   group serves it, else through CPU; a target elsewhere goes through a buffer there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..coordination.rendezvous import Rendezvous, all_succeeded
from .read_once import holder_groups

# A saved box of a tensor: its DCP name and start, stop in the saved tensor's coordinates.
BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class SharedRead:
    """A box several ranks' plans read: `reader` reads it, the other `holders` receive it."""

    key: BoxKey
    reader: int
    holders: tuple[int, ...]


@dataclass(frozen=True)
class ReadOncePlan:
    """The shared boxes of one `dcp.load`, in the one order every rank broadcasts them."""

    shared: tuple[SharedRead, ...]

    def holders_of(self) -> list[tuple[int, ...]]:
        return sorted({s.holders for s in self.shared})


def plan(keys: Sequence[Sequence[BoxKey]], nbytes: Callable[[BoxKey], int]) -> ReadOncePlan | None:
    """Step 2: `keys[r]` are the boxes rank r's plan reads. None when no box has several
    holders."""
    holders: dict[BoxKey, list[int]] = {}
    for rank, rank_keys in enumerate(keys):
        for key in dict.fromkeys(rank_keys):
            holders.setdefault(key, []).append(rank)
    load = [0] * len(keys)
    for key, ranks in holders.items():
        if len(ranks) == 1:
            load[ranks[0]] += nbytes(key)
    shared: list[SharedRead] = []
    boxes = [(k, r) for k, r in holders.items() if len(r) > 1 and nbytes(k) > 0]
    for key, ranks in sorted(boxes, key=lambda kr: (-nbytes(kr[0]), kr[0])):
        reader = min(ranks, key=lambda r: (load[r], r))
        load[reader] += nbytes(key)
        shared.append(SharedRead(key, reader, tuple(ranks)))
    return ReadOncePlan(tuple(shared)) if shared else None


def broadcast_device(devices: frozenset[str]) -> torch.device | None:
    """The device shared boxes travel on, the same on every rank of one group (a job's
    ranks all have CUDA or none has)."""
    if "cuda" in devices and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "cpu" in devices:
        return torch.device("cpu")
    return None


def share(
    once: ReadOncePlan,
    rank: int,
    regions: dict[BoxKey, list[torch.Tensor]],
    rv: Rendezvous,
    error: BaseException | None,
    device: torch.device,
) -> int:
    """Step 3 after the reads: agreement, then the broadcasts. `regions`: the target regions
    of this rank's shared boxes (filled where this rank read them). Returns the bytes this
    rank received."""
    all_succeeded(rv, "read", error)
    groups = holder_groups(once.holders_of(), rv.coord.process_count)
    received = 0
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []
    for s in once.shared:
        targets = regions.get(s.key)
        if rank not in s.holders or not targets:
            continue
        first = targets[0]
        direct = first.device == device and first.is_contiguous() and len(targets) == 1
        buf = first if direct else torch.empty(first.shape, dtype=first.dtype, device=device)
        if s.reader == rank and not direct:
            buf.copy_(first)
        work = torch.distributed.broadcast(
            buf.reshape(-1).view(torch.uint8), src=s.reader, group=groups[s.holders],
            async_op=True,
        )  # fmt: skip
        pending.append((work, buf, targets if s.reader != rank else []))
        if s.reader != rank:
            received += buf.numel() * buf.element_size()
    for work, buf, targets in pending:
        work.wait()
        for t in targets:
            if t is not buf:
                t.copy_(buf)
    return received
