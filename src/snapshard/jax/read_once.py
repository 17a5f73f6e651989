"""Read-once restore: each unique byte is read from storage by one process of the job, and
the copies that other processes hold arrive over the interconnect.

For a target whose sharding holds a box on several processes (data-parallel replicas), a
*read sharding* on the same devices is derived in which every byte lives on exactly one
device: the mesh axes the target leaves unused are appended to the spec of one array axis
(the first, in axis order, whose length they divide), after the axes already cutting it,
so that each device reads a piece of its own target box. Each process reads its boxes of
the read sharding through the ordinary restore executor, and one jitted identity with the
target as output sharding moves the bytes (an all-gather over the job's collectives);
arrays of one kind move stacked, one collective a stack (reshard.py).

Collectives must be entered by every process, so before them the processes agree, through
the coordinator, that every read of the batch succeeded: a process whose read failed
reports it and raises, and the others raise the same error, naming it, instead of waiting
in a collective that would never complete. Batches are cut from sizes every process
computes alike (the most host bytes any one process holds), so every process runs the
same batches and the same collectives in the same order.

A target that cuts the saved boxes' rows (planning/exchange.py: `Shard(0)` chunks onto a
column sharding) is read once the same way, replicated or not: its read sharding cuts the
first axis over every device, so that each process reads whole rows, contiguous in the
chunks, and the jitted identity exchanges them (an all-to-all).

With one process this is a no-op: boxes held by several local devices are already read
once and copied device to device.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checksum import crc32c
from ..coordination import default_coordinator
from ..coordination.base import Coordinator
from ..coordination.rendezvous import (
    Rendezvous,
    all_succeeded,
    namespace,
)
from ..dtypes import dtype_from_name
from ..options import ReadOptions
from ..planning.exchange import cuts_rows
from ..planning.layout import Box, slices_to_box
from ..reading import (
    Dest,
    Expand,
    ReadDests,
    ReadStats,
    Request,
    SavedBoxes,
    batches,
    request_boxes,
)
from ..reading import execute as execute_all
from ..reading.read_once_policy import too_small, wanted_alike
from . import reshard

if TYPE_CHECKING:
    import jax
    from jax.sharding import NamedSharding

    from ..reading.sources import CheckpointSource

_READ_AXIS = "snapshard_read"


@dataclass(frozen=True)
class LeafPlan:
    """How one (shape, target sharding) is read once: the read sharding, and per process the
    elements it holds in the target and in the read sharding, and the target elements it
    does not read itself."""

    read_sharding: jax.sharding.Sharding
    target_elements: tuple[int, ...]  # by process index
    read_elements: tuple[int, ...]
    from_peers_elements: tuple[int, ...]


def _size(box: Box) -> int:
    return math.prod(b - a for a, b in zip(*box, strict=True))


def _overlap(a: Box, b: Box) -> int:
    return math.prod(
        max(0, min(e1, e2) - max(s1, s2))
        for s1, e1, s2, e2 in zip(a[0], a[1], b[0], b[1], strict=True)
    )


def _boxes_by_process(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> dict[int, set[Box]]:
    out: dict[int, set[Box]] = {}
    index_map: dict[Any, Any] = dict(sharding.devices_indices_map(shape))
    for d, idx in index_map.items():
        out.setdefault(d.process_index, set()).add(slices_to_box(idx, shape))
    return out


def _holders(by_process: dict[int, set[Box]]) -> Counter[Box]:
    return Counter(b for boxes in by_process.values() for b in boxes)


def _named_candidates(sharding: NamedSharding, shape: tuple[int, ...]) -> list[NamedSharding]:
    """Read shardings for a NamedSharding: its unused mesh axes (all of them, then only those
    that span processes) appended to one array axis they divide, major axes first."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from .arrays import spec_axes

    mesh = sharding.mesh
    if getattr(mesh, "devices", None) is None:  # an abstract mesh
        return []
    ndim = len(shape)
    spec = [sharding.spec[i] if i < len(sharding.spec) else None for i in range(ndim)]
    used = {a for e in spec for a in spec_axes(e)}
    sizes = dict(mesh.shape)
    unused = [str(a) for a in mesh.axis_names if str(a) not in used and sizes[a] > 1]
    procs = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(mesh.devices)
    spans = [
        a for a in unused
        if np.any(procs != np.take(procs, [0], axis=list(mesh.axis_names).index(a)))
    ]  # fmt: skip
    out = []
    for extra in [unused, spans] if spans != unused else [unused]:
        if not extra:
            continue
        k = math.prod(sizes[a] for a in extra)
        for i in range(ndim):
            existing = spec_axes(spec[i])
            m = math.prod(sizes[a] for a in existing) * k
            if shape[i] % m:
                continue
            axes = existing + extra
            new = list(spec)
            new[i] = tuple(axes) if len(axes) > 1 else axes[0]
            out.append(NamedSharding(mesh, P(*new), memory_kind=sharding.memory_kind))
    return out


def _flat_candidates(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> list[NamedSharding]:
    """Other shardings: a 1-D mesh of their devices (process-major), cutting one axis."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices: list[Any] = sorted(sharding.device_set, key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), (_READ_AXIS,))
    out = []
    for i in range(len(shape)):
        if shape[i] % len(devices) == 0:
            spec: list[str | None] = [None] * len(shape)
            spec[i] = _READ_AXIS
            out.append(NamedSharding(mesh, P(*spec)))
    return out


def _band_candidates(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> list[Any]:
    """Read shardings that cut only the first axis, over every device: whole rows."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if not shape:
        return []
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        if getattr(mesh, "devices", None) is None or shape[0] % mesh.size:
            return []
        spec = P(tuple(mesh.axis_names), *([None] * (len(shape) - 1)))
        return [NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)]
    if shape[0] % len(sharding.device_set):
        return []
    return _flat_candidates(sharding, shape)[:1]


@lru_cache(maxsize=1024)
def target_boxes(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding
) -> tuple[np.ndarray, np.ndarray] | None:
    """The boxes of a target sharding (each once per process holding it), as (n, ndim)
    starts and stops."""
    try:
        boxes = [b for held in _boxes_by_process(sharding, shape).values() for b in held]
    except Exception:
        return None
    starts = np.array([b[0] for b in boxes], np.int64).reshape(len(boxes), len(shape))
    stops = np.array([b[1] for b in boxes], np.int64).reshape(len(boxes), len(shape))
    return starts, stops


@lru_cache(maxsize=1024)
def leaf_plan(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, cuts_saved_rows: bool = False
) -> LeafPlan | None:
    """The read-once plan of an array, or None when it would not reduce storage reads (no
    box is held by more than one process, and the target does not cut the saved rows) or
    when no read sharding fits its shape. Where it cuts them, read shardings of whole rows
    come first."""
    from jax.sharding import NamedSharding

    try:
        target = _boxes_by_process(sharding, shape)
    except Exception:  # shardings that cannot list their devices' boxes: read as usual
        return None
    replicated = any(n > 1 for n in _holders(target).values())
    if not replicated and not cuts_saved_rows:
        return None
    candidates = _band_candidates(sharding, shape) if cuts_saved_rows else []
    if replicated and isinstance(sharding, NamedSharding):
        candidates += _named_candidates(sharding, shape)
    elif replicated:
        candidates += _flat_candidates(sharding, shape)
    for rs in candidates:
        read = _boxes_by_process(rs, shape)
        if any(n > 1 for n in _holders(read).values()) or set(read) != set(target):
            continue
        procs = sorted(target)
        n = max(procs) + 1
        t_el, r_el, f_el = [0] * n, [0] * n, [0] * n
        for p in procs:
            t_el[p] = sum(_size(b) for b in target[p])
            r_el[p] = sum(_size(b) for b in read[p])
            mine = sum(_overlap(t, r) for t in target[p] for r in read[p])
            f_el[p] = t_el[p] - mine
        return LeafPlan(rs, tuple(t_el), tuple(r_el), tuple(f_el))
    return None


@dataclass
class _Once:
    request: Request  # the restore's request, onto its target sharding
    read_sharding: jax.sharding.Sharding  # the sharding each unique byte is read on
    cost: int  # the most host bytes one process holds for it (read pieces + target boxes)
    from_peers: int  # bytes of this process's target boxes it does not read itself


def plan(
    reqs: list[Request],
    process: int,
    processes: int,
    saved_boxes: SavedBoxes | None = None,
    read_once: bool | None = True,
) -> dict[int, _Once]:
    """The requests to read once (by index in `reqs`), each with the sharding to read it
    on (pure: `reqs` are left as they are; `_once_request` makes the requests on those
    shardings, once the processes agree to read once). Arrays of one shape, target
    sharding and saved boxes have one leaf plan, made once (a state has few kinds of
    arrays, many arrays). `read_once`: ReadOptions' (by default, None, small arrays are
    left out: read_once_policy.too_small)."""
    out: dict[int, _Once] = {}
    # (shape, sharding, ids of the saved boxes) -> (leaf plan, the saved boxes, kept alive
    # while their ids are keys; a checkpoint's finder shares them per layout and shape)
    alike: dict[Any, tuple[LeafPlan | None, Any]] = {}
    for i, r in enumerate(reqs):
        if r.kind != "jax" or r.sharding is None:
            continue
        shape = tuple(r.saved.shape)
        if too_small(r.saved.nbytes, read_once):
            continue
        saved = saved_boxes(r.saved) if saved_boxes is not None else None
        key = (shape, r.sharding, None if saved is None else (id(saved[0]), id(saved[1])))
        known = alike.get(key)
        if known is None:
            target = target_boxes(shape, r.sharding) if saved is not None else None
            cuts = saved is not None and target is not None and cuts_rows(*saved, *target)
            known = alike[key] = (leaf_plan(shape, r.sharding, cuts), saved)
        lp = known[0]
        if lp is None or len(lp.target_elements) != processes or 0 in lp.target_elements:
            continue  # (a sharding must span every process of the job to be read once)
        saved_size = dtype_from_name(r.saved.dtype).itemsize
        out_size = np.dtype(r.dtype).itemsize
        cost = max(
            t * out_size + e * saved_size
            for t, e in zip(lp.target_elements, lp.read_elements, strict=True)
        )
        from_peers = lp.from_peers_elements[process] * out_size
        out[i] = _Once(r, lp.read_sharding, cost, from_peers)
    return out


def _once_request(o: _Once, stacked: bool) -> Request:
    """The request that reads `o`'s array on its read sharding (`stacked`: as the host
    arrays of this process's boxes, which reshard.py stacks with others of its kind)."""
    r = o.request
    kind = "boxes" if stacked else "jax"
    return request_boxes(Request(r.saved, kind, r.dtype, o.read_sharding), o.read_sharding)


def execute(
    reqs: list[Request],
    source: CheckpointSource,
    options: ReadOptions,
    stats: ReadStats,
    *,
    location: str = "",
    expand: Expand | None = None,
    coord: Coordinator | None = None,
) -> list[Any]:
    """restore.execute over `source`, reading each unique byte of replicated jax targets,
    and of targets that cut the saved rows (`source.saved_boxes` tells), once per job
    (`options`: memory_budget, read_once, timeout_s).

    Every process must call it with the same targets (as every restore requires)."""
    coord = coord if coord is not None else default_coordinator()
    budget = options.memory_budget

    def read(dests: list[Dest]) -> None:
        source.read_dests(dests, stats)

    if options.read_once is False or coord.process_count == 1:
        return execute_all(reqs, read, memory_budget=budget, stats=stats, expand=expand)
    once = plan(
        reqs, coord.process_index, coord.process_count, source.saved_boxes, options.read_once
    )
    # Every process asks, with what its plan depends on: one whose targets differ from the
    # others' (or were refused, `refuse_target`) must not leave them in a collective.
    digest = _digest(reqs, once)
    if not wanted_alike(location, options.read_once, coord, options.timeout_s, digest) or not once:
        return execute_all(reqs, read, memory_budget=budget, stats=stats, expand=expand)
    rv = Rendezvous(coord, namespace("load", location), f"load of {location}", options.timeout_s)
    results: dict[int, Any] = {}
    error: BaseException | None = None
    rest = [i for i in range(len(reqs)) if i not in once]
    try:
        built = execute_all(
            [reqs[i] for i in rest], read, memory_budget=budget, stats=stats, expand=expand
        )
        results.update(zip(rest, built, strict=True))
    except Exception as e:
        error = e
    results.update(_read_and_share(once, read, budget, stats, expand, rv, error))
    return [results[i] for i in range(len(reqs))]


def _digest(reqs: list[Request], once: dict[int, _Once]) -> str:
    """What this process's read-once plan depends on, alike on every process whose targets
    are the others': the leaves asked for, and the targets and read shardings of those
    read once."""
    parts = [f"{r.saved.name}{r.dtype}" for r in reqs]
    parts += [f"{i}{once[i].request.sharding!r}{once[i].read_sharding!r}" for i in sorted(once)]
    return f"{crc32c('|'.join(parts).encode()):08x}"


def _read_and_share(
    once: dict[int, _Once],
    read: ReadDests,
    budget: int | None,
    stats: ReadStats,
    expand: Expand | None,
    rv: Rendezvous,
    error: BaseException | None,
) -> dict[int, Any]:
    """The read-once targets, batch by batch within `budget`: each process reads its share,
    then the shares are resharded onto the targets (an `error` of this process, or of any,
    raised on every process at the batch's rendezvous)."""
    import jax  # (here, not at the top: a restore without jax targets never imports JAX)

    results: dict[int, Any] = {}
    costs = {i: o.cost for i, o in once.items()}
    for k, batch in enumerate(batches(sorted(once), costs.__getitem__, budget)):
        stacks = reshard.stacks(batch, once)
        order = [i for s in stacks for i in s]
        reqs = {i: _once_request(once[i], len(s) > 1) for s in stacks for i in s}
        built: dict[int, Any] = {}
        if error is None:
            try:
                values = execute_all(
                    [reqs[i] for i in order], read, memory_budget=None, stats=stats, expand=expand
                )
                built = dict(zip(order, values, strict=True))
            except Exception as e:
                error = e
        all_succeeded(rv, f"read/{k}", error)
        t0 = time.perf_counter()
        moved = reshard.move(stacks, once, reqs, built)
        del built
        jax.block_until_ready(list(moved.values()))
        stats.reshard_s += time.perf_counter() - t0
        for i in batch:
            results[i] = moved[i]
            stats.bytes_from_peers += once[i].from_peers
    return results
