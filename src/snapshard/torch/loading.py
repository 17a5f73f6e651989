"""Restoring into torch state dicts: each rank reads exactly the boxes its tensors hold.

With a target state dict, every tensor leaf is filled in place: this rank's regions of it
(torch/target_fills.py), read in batches, with read-once among the ranks
(torch/load_reads.py). Python values of the target are replaced by the saved ones.
Entries the target omits are not read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

import numpy as np
import torch

from ..dtypes import dtype_from_name
from ..errors import TargetMismatchError
from ..format import ArrayLeaf, Manifest, ValueLeaf
from ..format.kinds import LeafKind
from ..format.leaves import PerProcessLeaf
from ..gc_pause import collection_paused
from ..options import ReadOptions
from ..per_process import PerProcess, Resplit
from ..reading import ReadDests, ReadStats
from ..reading.read_once_policy import refuse_target
from ..reading.restore import (
    missing_target_leaf,
    per_process_values,
    refuse_empty_containers,
    values_saved_elsewhere,
)
from ..reading.sources import TreeSource, open_for_load
from ..storage import Location, Storage
from ..transforms.surgery import Transform
from ..transforms.virtual import Derived, Stored, VArray
from ..tree import ABSENT, FlatTree, Path, flatten, path_str, unflatten, warn_lost_classes
from .coordination import default_coordinator
from .dtypes import torch_dtype
from .leaves import is_leaf, this_rank
from .load_reads import TargetArray, read_targets
from .target_fills import fills_of
from .values import into_target, is_dtensor, local_tensor, unstorable


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
    coord = default_coordinator()
    absent = values_saved_elsewhere(manifest, coord.process_index, coord.process_count)

    def leaf_target(i: int) -> Any:
        leaf = manifest.leaves[i]
        if isinstance(leaf, PerProcessLeaf):
            return ABSENT if i in absent else PerProcess(None)
        if isinstance(leaf, ValueLeaf):
            return leaf.value
        dtype = dtype_from_name(leaf.dtype)
        if leaf.kind == LeafKind.SCALAR:
            scalars[leaf.path] = out = np.empty((), dtype)
            return out
        dt = torch_dtype(dtype)
        return np.empty(leaf.shape, dtype) if dt is None else torch.empty(leaf.shape, dtype=dt)

    return unflatten(manifest.structure, leaf_target), scalars


def _refuse_unfillable_target(t: torch.Tensor, leaf: str, url: str) -> None:
    local = local_tensor(t) if is_dtensor(t) else t
    if t.is_meta or local.is_meta:
        raise TargetMismatchError(
            f"{url}: target leaf {leaf!r} is on the meta device (a shape without memory), so "
            "nothing can be loaded into it; materialise it first (model.to_empty(device=...)), "
            "then load"
        )
    why = unstorable(local, target=True)
    if why is not None:
        raise TargetMismatchError(f"{url}: target leaf {leaf!r} is {why}")


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
    flat = flatten(target, is_leaf) if target is not None else None  # (flattened once)
    values_only = flat is not None and not any(
        isinstance(x, torch.Tensor | np.ndarray) for x in flat.leaves
    )

    def refused(url: str, e: Exception) -> NoReturn:
        """The other ranks learn it rather than wait for this one (a load into a target)."""
        if target is None or values_only:  # (each rank on its own: see below)
            raise e
        refuse_target(url, options.read_once, default_coordinator(), options.timeout_s, e)

    with open_for_load(directory, options, stats, refused) as (storage, source, read):
        manifest = source.manifest
        if target is None:
            whole, scalars = _whole_target(manifest)
            # Each rank on its own, as before a target existed: a rank may load a whole
            # checkpoint alone (to look into it), so nothing waits for the other ranks.
            alone = dataclasses.replace(options, read_once=False)
            whole_flat = flatten(whole, is_leaf)
            out = _load_into(storage, source, read, whole, whole_flat, alone, stats, None, resplit)
            out = _put_back(out, (), {p: a[()] for p, a in scalars.items()})
        else:
            table = manifest.processes
            if values_only and (table is None or table.leaf_map is None):
                # Nothing to read together (Python and per-process values): one rank may
                # look up the step alone. (Where trees differ by rank, a rank without
                # arrays still takes part in the others' exchange: see _read_once.)
                options = dataclasses.replace(options, read_once=False)
            assert flat is not None
            out = _load_into(
                storage, source, read, target, flat, options, stats, transform, resplit
            )
    if target is None:
        warn_lost_classes(manifest.structure, hint=TORCH_TARGET_HINT)
    return out


def _load_into(
    storage: Storage,
    source: TreeSource,
    read: ReadDests,
    target: Any,
    flat: FlatTree,
    options: ReadOptions,
    stats: ReadStats,
    transform: Transform | None,
    resplit: Resplit | None,
) -> Any:
    """`load` with the checkpoint open: fill `target` (`flat`: it flattened), return it."""
    try:
        arrays, values = _checked_targets(storage, source, target, flat, transform, resplit)
    except Exception as e:  # the other ranks learn it rather than wait for this one
        coord = default_coordinator()
        refuse_target(storage.url, options.read_once, coord, options.timeout_s, e)
    read_targets(arrays, read, options, stats, storage.url, source.saved_boxes)
    return _put_back(target, (), values)


def _checked_targets(
    storage: Storage,
    source: TreeSource,
    target: Any,
    flat: FlatTree,
    transform: Transform | None,
    resplit: Resplit | None,
) -> tuple[list[TargetArray], dict[Path, Any]]:
    """The target's arrays to read (`flat`: the target flattened), each checked against its
    saved leaf, and its values (Python values, this rank's per-process values) by path."""
    url, manifest = storage.url, source.manifest
    saved = manifest.leaf_by_path()
    values: dict[Path, Any] = {}
    arrays: list[TargetArray] = []
    own: list[tuple[Path, PerProcessLeaf, Any]] = []
    mapped = _transformed(saved, transform, url) if transform is not None else None
    names = list(mapped) if mapped is not None else [leaf.name for leaf in manifest.leaves]
    table = manifest.processes
    # A rank that holds none of a state whose trees differ by rank (its target has no
    # leaves) takes part in the load with nothing to fill; elsewhere that is a mistake.
    nothing_here = not flat.paths and table is not None and table.leaf_map is not None
    if not (nothing_here and default_coordinator().process_count > 1):
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
            _refuse_unfillable_target(t, leaf.name, url)
        shape = leaf.shape if perm is None else tuple(leaf.shape[p] for p in perm)
        if tuple(t.shape) != shape:
            raise TargetMismatchError(
                f"{url}: leaf {leaf.name!r} has shape {shape} in the checkpoint"
                + (" (transposed)" if perm is not None else "")
                + f", the target asks for {tuple(t.shape)}"
            )
        arrays.append((t, fills_of(leaf, t, rank, perm), leaf, leaf if perm is None else None))
    values.update(_own_values(storage, manifest, own, resplit))
    return arrays, values


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
