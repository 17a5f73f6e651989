"""Who reads which box in a read-once restore: pure, over layouts or the boxes each process
asks for, no I/O, no framework. The torch wing carries the plans out
(torch/read_once.py: the reads, then one broadcast per shared box); the JAX wing reads
once through read shardings of its own (jax/read_once.py).

- `plan_holders`: from the target layouts, which every process computes alike without
  talking: the write planner's byte-balanced assignment, so that the process that would
  write a box is the one that reads it (snapshard.torch.load).
- `plan_dcp`: from the boxes each process's load plan reads, gathered on one coordinator
  (dcp.load): each box several plans read goes to the holder with the fewest bytes to read
  so far, largest boxes first, in one order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .layout import ArrayLayout, Box
from .write_plan import plan_balanced


def as_box(start: Any, stop: Any) -> Box:
    """A box as a hashable value, from its start and stop coordinates."""
    return tuple(int(x) for x in start), tuple(int(x) for x in stop)


@dataclass(frozen=True)
class SharedBox:
    """A box of target leaf `leaf` held by `holders` (ascending ranks), read by `reader`."""

    leaf: int
    box: Box
    reader: int
    holders: tuple[int, ...]


def plan_holders(
    layouts: list[ArrayLayout | None], rank: int, world: int
) -> tuple[frozenset[int], set[tuple[int, Box]], list[SharedBox]] | None:
    """The leaves planned (those with a layout of some bytes; None: a leaf every process
    reads itself), the (leaf, box) that process `rank` reads, and every box several
    processes hold, in the one order of all processes; None when no box is shared."""
    chosen = [(i, la) for i, la in enumerate(layouts) if la is not None and la.nbytes > 0]
    if not chosen:
        return None
    leaves = [i for i, _ in chosen]
    plans, _, _ = plan_balanced([la for _, la in chosen], world)
    reads: set[tuple[int, Box]] = set()
    shared: list[SharedBox] = []
    for i, p in zip(leaves, plans, strict=True):
        g = p.groups
        for u in range(g.count):
            if g.nbytes[u] == 0:
                continue
            box = as_box(g.starts[u], g.stops[u])
            lo, hi = int(g.cand_ptr[u]), int(g.cand_ptr[u + 1])
            holders = tuple(sorted(int(x) for x in g.cand_process[lo:hi]))
            reader = int(p.writer[u])
            if reader == rank:
                reads.add((i, box))
            if len(holders) > 1:
                shared.append(SharedBox(i, box, reader, holders))
    if not shared:
        return None
    return frozenset(leaves), reads, shared


# A saved box of a tensor: its DCP name and start, stop in the saved tensor's coordinates.
BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class SharedRead:
    """A box several ranks' plans read: `reader` reads it, the other `holders` receive it."""

    key: BoxKey
    reader: int
    holders: tuple[int, ...]


@dataclass(frozen=True)
class DcpReadOncePlan:
    """The shared boxes of one `dcp.load`, in the one order every rank broadcasts them."""

    shared: tuple[SharedRead, ...]

    def holders_of(self) -> list[tuple[int, ...]]:
        return sorted({s.holders for s in self.shared})


def plan_dcp(
    keys: Sequence[Sequence[BoxKey]], nbytes: Callable[[BoxKey], int]
) -> DcpReadOncePlan | None:
    """`keys[r]` are the boxes rank r's plan reads, `nbytes` a box's size. None when no box
    has several holders."""
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
    return DcpReadOncePlan(tuple(shared)) if shared else None
