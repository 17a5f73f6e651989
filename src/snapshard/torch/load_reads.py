"""A load's reads of its target arrays: every fill (torch/target_fills.py) in batches under
the memory budget; with read-once, only this rank's share, then the rest from its peers: a
box several ranks hold is read by one and broadcast (torch/read_once.py), a target that
cuts the saved rows is read as bands of whole rows, then exchanged (torch/band_plan.py,
torch/exchange.py).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..checksum import crc32c
from ..coordination.rendezvous import Rendezvous, namespace
from ..format import ArrayLeaf
from ..options import ReadOptions
from ..planning.layout import Box
from ..planning.read_once import as_box
from ..reading import BATCH_ITEMS, Dest, ReadDests, ReadStats, SavedBoxes, fill
from ..reading.read_once_policy import too_small, wanted_alike
from .band_plan import BandLeaf, Cuts, batches_of
from .band_plan import plan as plan_bands
from .coordination import default_coordinator
from .exchange import Exchange, Scratch, SharedBands
from .read_once import ReadOncePlan, any_shared, backend_devices
from .read_once import plan as plan_read_once
from .target_fills import TargetFill, store
from .values import is_dtensor

# A target leaf, its fills (this rank's), its saved leaf, and that leaf again where the
# target may be read from it as bands (None: not, a transposed one).
TargetArray = tuple[Any, list[TargetFill], ArrayLeaf, ArrayLeaf | None]


def _read_once(
    arrays: list[TargetArray], options: ReadOptions, url: str, boxes: SavedBoxes
) -> tuple[ReadOncePlan | None, list[BandLeaf], Rendezvous | None]:
    """The read-once plans of a load, broadcasts (torch/read_once.py) and bands
    (torch/band_plan.py), and their rendezvous; nothing where read-once is off."""
    coord = default_coordinator()
    if coord.process_count == 1 or options.read_once is False:
        return None, [], None
    # Every rank asks, whatever its own target holds: the ranks' targets may differ
    # (pipeline stages: one rank's plans empty, another's not), and a rank whose target was
    # refused says so in the same exchange (read_once_policy.refuse_target). The plans are made only where
    # the policy says yes (on a local disk it says no).
    if not wanted_alike(url, options.read_once, coord, options.timeout_s, _digest(arrays)):
        return None, [], None
    devices = backend_devices()
    world = coord.process_count
    cuts = Cuts(boxes)
    targets = [t for t, *_ in arrays]
    if not any_shared(targets, world, devices) and not (
        "cpu" in devices and any(cuts.banded(t, s) for t, _, _, s in arrays)
    ):
        return None, [], None
    banded = plan_bands(
        targets, [s for *_, s in arrays], world, devices, boxes, options.memory_budget
    )
    skip = {b.leaf for b in banded}
    skip |= {  # (from what every rank knows alike: the saved leaf, not this rank's fills)
        i for i, (t, _, leaf, _) in enumerate(arrays)
        if isinstance(t, torch.Tensor) and too_small(leaf.nbytes, options.read_once)
    }  # fmt: skip
    once = plan_read_once(
        [None if i in skip else t for i, t in enumerate(targets)],
        coord.process_index, world, devices,
    )  # fmt: skip
    if once is None and not banded:
        return None, [], None
    # Taken here, in program order, the same on every rank.
    rv = Rendezvous(coord, namespace("load", url), f"load of {url}", options.timeout_s)
    return once, banded, rv


def _digest(arrays: list[TargetArray]) -> str:
    """What a rank's read-once plans depend on: its target leaves' names, shapes, dtypes
    and placements over their meshes' ranks."""
    meshes: dict[int, str] = {}
    parts = []
    for t, _, leaf, _ in arrays:
        where = type(t).__name__
        if isinstance(t, torch.Tensor) and is_dtensor(t):
            mesh = t.device_mesh  # type: ignore[attr-defined]
            if id(mesh) not in meshes:
                meshes[id(mesh)] = str(mesh.mesh.tolist())
            where = f"{t.placements}{meshes[id(mesh)]}"  # type: ignore[attr-defined]
        parts.append(f"{leaf.name}{tuple(t.shape)}{t.dtype}{where}")
    return f"{crc32c('|'.join(parts).encode()):08x}"


def read_targets(
    arrays: list[TargetArray],
    read: ReadDests,
    options: ReadOptions,
    stats: ReadStats,
    url: str,
    boxes: SavedBoxes,
) -> None:
    """Read every fill of the target leaves, in batches under the memory budget; with
    read-once, only this rank's share, then the rest from its peers."""
    once, banded, rv = _read_once(arrays, options, url, boxes)
    banded_leaves = {b.leaf for b in banded}
    fills = [
        f
        for i, (_, fs, _, _) in enumerate(arrays)
        if i not in banded_leaves
        for f in (once.bind(i, fs) if once is not None else fs)
    ]
    error: BaseException | None = None

    def timed_read(dests: list[Dest]) -> None:
        t = time.perf_counter()
        read(dests)
        stats.read_s += time.perf_counter() - t

    with torch.no_grad():
        try:
            fill(fills, read, stats, budget=options.memory_budget, most=BATCH_ITEMS)
        except Exception as e:
            if rv is None:
                raise
            error = e  # every rank must learn of it before any collective
        if rv is None:
            return
        t0 = time.perf_counter()
        read_s = stats.read_s
        regions = {
            (i, as_box(f.start, f.stop)): f.region for i in banded_leaves for f in arrays[i][1]
        }
        error = _exchange_bands(banded, regions, timed_read, rv, options, stats, error)
        if once is not None:
            stats.bytes_from_peers += once.share(rv, error)
        elif error is not None:  # a failure after the last collective: this rank's alone
            raise error
        stats.reshard_s += time.perf_counter() - t0 - (stats.read_s - read_s)


def _exchange_bands(
    banded: list[BandLeaf],
    regions: dict[tuple[int, Box], Any],
    read: ReadDests,
    rv: Rendezvous,
    options: ReadOptions,
    stats: ReadStats,
    error: BaseException | None,
) -> BaseException | None:
    """Read this rank's bands of the banded leaves and exchange them with its peers, in
    batches under the memory budget (in shared memory where the ranks share a host);
    returns the first failure of any rank (raised on every rank at the collectives)."""
    groups = batches_of(banded, options.memory_budget, shared=True)
    shared = SharedBands.open(rv, groups) if groups else None
    if shared is None:
        groups = batches_of(banded, options.memory_budget)
    bands = Exchange(regions, read, store, rv, Scratch(), shared)
    try:
        for k, group in enumerate(groups):
            # (a failure anywhere raises on every rank here, before the collective)
            received, error = bands.run(k, group, error)
            stats.bytes_from_peers += received
    finally:
        if shared is not None:
            shared.close()
    return error
