"""Restoring into torch state dicts: each rank reads exactly the boxes its tensors hold.

With a target state dict, every tensor leaf is filled in place: a DTensor's local shard
(its boxes computed from its own mesh and placements, whatever mesh the checkpoint was
saved from), a plain tensor or NumPy array whole. Where a target region is one contiguous
CPU block of the saved dtype, the reads land in the tensor's memory directly; otherwise
they go through a host buffer, are cast if the dtypes differ, and are copied in. Python
values of the target are replaced by the saved ones. Entries the target omits are not read.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import torch

from ..checksum import crc32c
from ..coordination.rendezvous import Rendezvous, namespace
from ..dtypes import dtype_from_name
from ..errors import TargetMismatchError
from ..format import ArrayLeaf, Manifest, ValueLeaf
from ..format.kinds import LeafKind
from ..format.leaves import PerProcessLeaf
from ..gc_pause import collection_paused
from ..options import ReadOptions
from ..per_process import PerProcess, Resplit
from ..planning.layout import Box
from ..planning.read_once import as_box
from ..read_once_policy import too_small, wanted_alike
from ..reading import (
    BATCH_ITEMS,
    Dest,
    ReadDests,
    ReadStats,
    SavedBoxes,
    aligned_empty,
    fill,
)
from ..reading.sources import TreeSource, open_for_load
from ..restore import missing_target_leaf, per_process_values, refuse_empty_containers
from ..storage import Location, Storage
from ..transforms.surgery import Transform
from ..transforms.virtual import Derived, Stored, VArray
from ..tree import Path, flatten, path_str, unflatten, warn_lost_classes
from .coordination import default_coordinator
from .dtypes import from_numpy, host_view, numpy_dtype, torch_dtype
from .exchange import BandLeaf, Cuts, Exchange, Scratch, SharedBands, batches_of
from .exchange import plan as plan_bands
from .leaves import dtensor_layout, is_leaf, this_rank
from .read_once import ReadOncePlan, any_shared, backend_devices
from .read_once import plan as plan_read_once
from .values import into_target, is_dtensor, local_tensor


class _Fill:
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
        _store(self.region, data if self.perm is None else data.transpose(self.perm))
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


def _fills(
    leaf: ArrayLeaf, target: Any, rank: int, perm: tuple[int, ...] | None = None
) -> list[_Fill]:
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
        out.append(_Fill(leaf, (start, stop), target_start, target_stop, region, flat, perm))
    return out


def _store(region: Any, data: np.ndarray) -> None:
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


def _resolve(x: VArray, name: str, url: str) -> tuple[str, tuple[int, ...] | None]:
    """(saved leaf name, permutation or None) of a transform's result: a saved array,
    renamed, transposed and/or cast (the target's dtype decides the cast)."""
    perm: tuple[int, ...] | None = None
    while isinstance(x, Derived) and x.kind in ("transpose", "cast") and x.child is not None:
        if x.kind == "transpose":
            perm = x.perm if perm is None else tuple(x.perm[p] for p in perm)
        x = x.child
    if not isinstance(x, Stored):
        raise TargetMismatchError(
            f"{url}: target leaf {name!r}: loading a snapshard checkpoint into torch takes "
            "rename, transpose and cast transforms; fuse, split, stack and reshape work when "
            "loading safetensors files (snapshard.safetensors.load)"
        )
    return x.name, perm


def _transformed(
    saved: dict[Path, Any], transform: Transform, url: str
) -> dict[str, tuple[Any, tuple[int, ...] | None]]:
    """Target name -> (saved leaf, permutation) through `transform` (snapshard.safetensors
    .surgery) applied to the saved arrays, which it sees under their names."""
    by_name = {leaf.name: leaf for leaf in saved.values()}
    arrays = {
        leaf.name: Stored(leaf.shape, dtype_from_name(leaf.dtype), leaf.name)
        for leaf in saved.values()
        if isinstance(leaf, ArrayLeaf)
    }
    out: dict[str, tuple[Any, tuple[int, ...] | None]] = {
        leaf.name: (leaf, None) for leaf in saved.values() if isinstance(leaf, ValueLeaf)
    }
    for name, x in transform(arrays).items():
        source, perm = _resolve(x, name, url)
        out[name] = (by_name[source], perm)
    return out


# A target leaf, its fills (this rank's), its saved leaf, and that leaf again where the
# target may be read from it as bands (None: not, a transposed one).
_Array = tuple[Any, list[_Fill], ArrayLeaf, ArrayLeaf | None]


def _read_once(
    arrays: list[_Array], options: ReadOptions, url: str, boxes: SavedBoxes
) -> tuple[ReadOncePlan | None, list[BandLeaf], Rendezvous | None]:
    """The read-once plans of a load, broadcasts (torch/read_once.py) and bands
    (torch/exchange.py), and their rendezvous; nothing where read-once is off."""
    coord = default_coordinator()
    if coord.process_count == 1 or options.read_once is False:
        return None, [], None
    devices = backend_devices()
    world = coord.process_count
    # Whether the plans below would be empty, told first and cheaply: the policy is asked
    # only where they are not (on a filesystem that is an agreement of the ranks), and on a
    # local disk it says no, so a restore there never pays for the plans themselves.
    cuts = Cuts(boxes)
    targets = [t for t, *_ in arrays]
    if not any_shared(targets, world, devices) and not (
        "cpu" in devices and any(cuts.banded(t, s) for t, _, _, s in arrays)
    ):
        return None, [], None
    # The ranks' targets may differ (pipeline stages): each rank plans from its own.
    if not wanted_alike(url, options.read_once, coord, options.timeout_s, _digest(arrays)):
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


def _digest(arrays: list[_Array]) -> str:
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


def _read_targets(
    arrays: list[_Array],
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
    bands = Exchange(regions, read, _store, rv, Scratch(), shared)
    try:
        for k, group in enumerate(groups):
            # (a failure anywhere raises on every rank here, before the collective)
            received, error = bands.run(k, group, error)
            stats.bytes_from_peers += received
    finally:
        if shared is not None:
            shared.close()
    return error


def _put_back(node: Any, path: Path, values: dict[Path, Any]) -> Any:
    """The target with its value leaves replaced, containers updated in place where mutable."""
    if path in values:
        return values[path]
    if type(node) is dict:
        for k in list(node.keys()):
            node[k] = _put_back(node[k], (*path, k), values)
        return node
    if type(node) is list:
        for i, v in enumerate(node):
            node[i] = _put_back(v, (*path, i), values)
        return node
    if type(node) is tuple:
        return tuple(_put_back(v, (*path, i), values) for i, v in enumerate(node))
    if isinstance(node, tuple) and hasattr(type(node), "_fields"):
        return type(node)(*[_put_back(getattr(node, f), (*path, f), values) for f in node._fields])  # type: ignore[attr-defined]
    return node


TORCH_TARGET_HINT = (
    "pass a target state dict to get them back: snapshard.torch.load(path, state_dict) "
    "fills it in place"
)


def _whole_target(manifest: Manifest) -> tuple[Any, dict[Path, Any]]:
    """A target for the whole checkpoint, when none is given: a CPU tensor per array (a
    NumPy array for dtypes torch lacks), the saved value per Python value, in plain
    containers; and the NumPy scalars' paths, which come back as NumPy scalars."""
    scalars: dict[Path, Any] = {}

    def leaf_target(i: int) -> Any:
        leaf = manifest.leaves[i]
        if isinstance(leaf, PerProcessLeaf):
            return PerProcess(None)
        if isinstance(leaf, ValueLeaf):
            return leaf.value
        dtype = dtype_from_name(leaf.dtype)
        if leaf.kind == LeafKind.SCALAR:
            scalars[leaf.path] = out = np.empty((), dtype)
            return out
        dt = torch_dtype(dtype)
        return np.empty(leaf.shape, dtype) if dt is None else torch.empty(leaf.shape, dtype=dt)

    return unflatten(manifest.structure, leaf_target), scalars


def _refuse_meta_target(t: torch.Tensor, leaf: str, url: str) -> None:
    if t.is_meta or (is_dtensor(t) and local_tensor(t).is_meta):
        raise TargetMismatchError(
            f"{url}: target leaf {leaf!r} is on the meta device (a shape without memory), so "
            "nothing can be loaded into it; materialise it first (model.to_empty(device=...)), "
            "then load"
        )


@collection_paused()
def load(
    directory: Location | Storage,
    target: Any = None,
    options: ReadOptions = ReadOptions(),
    *,
    stats: ReadStats | None = None,
    transform: Transform | None = None,
    resplit: Resplit | None = None,
) -> Any:
    """Restore a checkpoint into `target` (a state dict of tensors, DTensors, NumPy arrays
    and Python values), in place, and return it. Without a target: the whole checkpoint as
    CPU tensors (NumPy arrays for dtypes torch lacks) and Python values.

    Values saved in snapshard.PerProcess come back as this rank's own (a tensor of the
    target is filled in place); on another world size `resplit(leaf, values, rank, world)`
    gives this rank's value from every saved rank's, as in snapshard.load.

    `transform` maps the saved names to the target's with the surgery transforms of
    snapshard.safetensors (`rename`, `transpose`, `cast`, `chain`), e.g. a JAX model's
    `params/dense/kernel` onto torch's `dense.weight`, transposed; each rank still reads
    only the boxes its shards hold.

    Any checkpoint snapshard reads works: one saved from JAX, from torch on another mesh or
    world size, or by Orbax. `options` as in snapshard.load; `options.memory_budget` bounds
    the host bytes of buffers held at once (regions read in place need none), and with
    `options.read_once` a box several ranks hold is read by one and broadcast to the
    others (torch/read_once.py), and a target that cuts the saved rows is read as bands
    of whole rows, then exchanged (torch/exchange.py). Every rank passes the same target
    and options."""
    if target is None and transform is not None:
        raise ValueError("transform= needs a target: the state dict whose names it maps onto")
    stats = stats if stats is not None else ReadStats()
    with open_for_load(directory, options, stats) as (storage, source, read):
        manifest = source.manifest
        if target is None:
            whole, scalars = _whole_target(manifest)
            # Each rank on its own, as before a target existed: a rank may load a whole
            # checkpoint alone (to look into it), so nothing waits for the other ranks.
            alone = dataclasses.replace(options, read_once=False)
            out = _load_into(storage, source, read, whole, alone, stats, None, resplit)
            out = _put_back(out, (), {p: a[()] for p, a in scalars.items()})
        else:
            out = _load_into(storage, source, read, target, options, stats, transform, resplit)
    if target is None:
        warn_lost_classes(manifest.structure, hint=TORCH_TARGET_HINT)
    return out


def _load_into(
    storage: Storage,
    source: TreeSource,
    read: ReadDests,
    target: Any,
    options: ReadOptions,
    stats: ReadStats,
    transform: Transform | None,
    resplit: Resplit | None,
) -> Any:
    """`load` with the checkpoint open: fill `target`, return it."""
    url, manifest = storage.url, source.manifest
    saved = manifest.leaf_by_path()
    flat = flatten(target, is_leaf)
    values: dict[Path, Any] = {}
    arrays: list[_Array] = []
    own: list[tuple[Path, PerProcessLeaf, Any]] = []
    mapped = _transformed(saved, transform, url) if transform is not None else None
    names = list(mapped) if mapped is not None else [leaf.name for leaf in manifest.leaves]
    refuse_empty_containers(url, target, names)
    rank = this_rank()
    for path, t in zip(flat.paths, flat.leaves, strict=True):
        perm = None
        if mapped is not None:
            leaf, perm = mapped.get(path_str(path), (None, None))
        else:
            leaf = saved.get(path)
        if leaf is None:
            raise missing_target_leaf(url, path, saved)
        if isinstance(leaf, PerProcessLeaf):
            own.append((path, leaf, t.value if isinstance(t, PerProcess) else t))
            continue
        is_array = isinstance(t, torch.Tensor | np.ndarray)
        if isinstance(leaf, ValueLeaf):
            if is_array:
                raise TargetMismatchError(
                    f"{url}: leaf {leaf.name!r} is a saved {type(leaf.value).__name__} value, "
                    "the target has an array"
                )
            values[path] = leaf.value
            continue
        if not is_array:
            raise TargetMismatchError(
                f"{url}: leaf {leaf.name!r} is a saved array, the target has {type(t).__name__}"
            )
        if isinstance(t, torch.Tensor):
            _refuse_meta_target(t, leaf.name, url)
        shape = leaf.shape if perm is None else tuple(leaf.shape[p] for p in perm)
        if tuple(t.shape) != shape:
            raise TargetMismatchError(
                f"{url}: leaf {leaf.name!r} has shape {shape} in the checkpoint"
                + (" (transposed)" if perm is not None else "")
                + f", the target asks for {tuple(t.shape)}"
            )
        arrays.append((t, _fills(leaf, t, rank, perm), leaf, leaf if perm is None else None))
    values.update(_own_values(storage, manifest, own, resplit))
    _read_targets(arrays, read, options, stats, url, source.saved_boxes)
    return _put_back(target, (), values)


def _own_values(
    storage: Storage,
    manifest: Manifest,
    own: list[tuple[Path, PerProcessLeaf, Any]],
    resplit: Resplit | None,
) -> dict[Path, Any]:
    """This rank's values of the per-rank leaves, into their targets."""
    if not own:
        return {}
    leaves = [leaf for _, leaf, _ in own]
    got = per_process_values(storage, manifest, leaves, resplit, default_coordinator())
    return {
        path: into_target(got[leaf.path], t, f"{storage.url}: leaf {leaf.name!r}")
        for path, leaf, t in own
    }
