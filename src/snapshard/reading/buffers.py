"""Host buffers and batching: what every reader of the package fills and how it cuts its work.

`Dest` is one box of a saved array and the aligned host buffer it is read into; `ReadDests`
is the seam a source implements (fill these buffers); `batches` cuts a restore's work under
its memory budget; `ReadStats` counts what a load read. Framework-neutral: no JAX, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ..format import ArrayLeaf

# Buffers start at multiples of this (XLA's CPU client aliases 64-byte aligned buffers).
ALIGN = 64


@dataclass
class ReadStats:
    """What a load read on this process. bytes_needed counts each box read once (with
    read-once, this process's share of the replicated leaves); bytes_from_peers counts the
    bytes of this process's target boxes that other processes read and sent."""

    bytes_needed: int = 0
    bytes_read: int = 0
    bytes_from_peers: int = 0
    metadata_bytes: int = 0  # chunk records read (v2), beside the manifest
    reads: int = 0
    chunks_touched: int = 0
    read_s: float = 0.0
    assemble_s: float = 0.0
    reshard_s: float = 0.0  # read-once: moving the bytes read onto the target shardings
    total_s: float = 0.0

    @property
    def read_amplification(self) -> float:
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(self.__dict__)
        d["read_amplification"] = self.read_amplification
        return d


def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 buffer whose data pointer is 64-byte aligned (lets XLA's CPU client alias it)."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + nbytes]


@dataclass(slots=True)  # (a restore of many small arrays makes one per shard)
class Dest:
    """One host buffer to fill: box [start, stop) of a saved array."""

    leaf: ArrayLeaf
    start: np.ndarray
    stop: np.ndarray
    buf: np.ndarray
    box_shape: tuple[int, ...] | None = None  # stop - start, where the maker knows it

    @property
    def shape(self) -> tuple[int, ...]:
        if self.box_shape is not None:
            return self.box_shape
        return tuple(int(x) for x in self.stop - self.start)


T = TypeVar("T")


# The most regions one batch of a PyTorch restore, or of a JAX restore onto accelerators,
# reads (`batches`' `most`): what a batch holds per region besides its bytes (its chunk
# table, fill, destination and read plan, about 2 KiB) then stays bounded however many
# small arrays a state has. (On JAX's CPU backend the arrays keep their host buffers, and
# such batches measured slower: no bound there.)
BATCH_ITEMS = 2048


def batches(
    items: Sequence[T], size: Callable[[T], int], budget: int | None, most: int | None = None
) -> list[list[T]]:
    """Consecutive items in batches of at most `budget` bytes by `size` (an item larger
    than the budget goes alone; None: no bound on bytes) and at most `most` items (None:
    no bound). Every restore path cuts its work with it, so that every process of a job
    cuts the same batches from the same sizes."""
    out: list[list[T]] = []
    cur: list[T] = []
    total = 0
    for it in items:
        n = size(it)
        if cur and (len(cur) == most or (budget is not None and total + n > budget)):
            out.append(cur)
            cur, total = [], 0
        cur.append(it)
        total += n
    if cur:
        out.append(cur)
    return out


# Fills destination buffers from storage (the restore's reads, or another format's reader).
ReadDests = Callable[[list[Dest]], None]
