"""torch leaves of a state dict: tensors and DTensors to layouts, and back to host memory.

A DTensor's layout comes from its mesh and placements alone (see layout.py); a plain tensor
is taken to be the same on every rank (like a NumPy leaf: written once, by the rank the
planner picks), and the save checks that it is (its digest, compared at commit). Values
that differ by design are wrapped in snapshard.PerProcess. Process ids are global ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..checksum import crc32c
from ..errors import UnsupportedLeafError
from ..format.kinds import LeafKind
from ..format.leaves import PerProcessLeaf, ValueLeaf
from ..per_process import PerProcess, checked
from ..planning.layout import host_layout, own_layout
from ..saving import ReplicatedSource
from ..saving.copies import sample_indices, signs
from ..saving.save_array import VALUE_TYPES, SaveArray
from ..tree import Path, path_str
from .dtypes import TO_NUMPY, host_view, numpy_dtype
from .layout import PlacementSpec, ShardSpec, TensorLayout, expand_submesh, tensor_layout
from .values import host_values, is_dtensor, local_tensor, refuse_meta, unstorable

# torch objects that are not state: taken as leaves so that the save names them and says
# what to save instead (flattening would only say that it cannot take them apart).
NOT_STATE = (
    torch.dtype, torch.device, torch.Size, torch.nn.Module, torch.optim.Optimizer,
    torch.Generator,
)  # fmt: skip


def is_leaf(x: Any) -> bool:
    return isinstance(
        x, (torch.Tensor, np.ndarray, np.generic, PerProcess, *VALUE_TYPES, *NOT_STATE)
    )


def not_state(value: Any, leaf: str) -> UnsupportedLeafError:
    """The error for a torch object that is not state, saying what to save instead."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, torch.nn.Module | torch.optim.Optimizer):
        what = "module" if isinstance(value, torch.nn.Module) else "optimizer"
        fix = (
            f"save its state dict instead: {what}.state_dict(), or for FSDP/DTensor models "
            "get_state_dict(model, optimizer) from torch.distributed.checkpoint.state_dict"
        )
    elif isinstance(value, torch.Generator):
        fix = "save its state instead: generator.get_state() (a tensor; per rank in snapshard.PerProcess)"
    elif isinstance(value, torch.Size):
        fix = "save it as a tuple: tuple(size)"
    else:
        fix = f"save it as a string, str(value) = {str(value)!r}, and rebuild it after loading"
    return UnsupportedLeafError(f"leaf {leaf!r}: a {kind} is not a tensor or a value; {fix}")


def placement_specs(placements: Any, leaf: str = "?") -> list[PlacementSpec]:
    """DTensor placements as layout.py's specs; Partial (pending reduction) is refused."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[PlacementSpec] = []
    for m, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            out.append(ShardSpec(int(p.dim), int(p.split_factor)))
        elif isinstance(p, Shard):
            out.append(ShardSpec(int(p.dim)))
        elif isinstance(p, Replicate):
            out.append(None)
        elif p.is_partial():
            raise UnsupportedLeafError(
                f"leaf {leaf!r}: DTensor has a Partial placement ({p}) on mesh dimension {m}: "
                "its local tensors are unreduced partial values; redistribute it to Shard or "
                "Replicate before saving"
            )
        else:
            raise UnsupportedLeafError(f"leaf {leaf!r}: DTensor placement {p!r} is not supported")
    return out


_mesh_cache: dict[int, tuple[Any, np.ndarray, bool]] = {}


def mesh_ranks(mesh: Any, widen: bool = True) -> tuple[np.ndarray, bool]:
    """The rank tensor to lay a DTensor out on, and whether it was widened: a sub-mesh of a
    bigger root mesh is stacked with its copies (which hold the same data) on a new first
    dimension, so that every rank of the root knows every holder without asking. Not in a
    save of differing trees (`widen` False), where the copies hold other stages' or experts' data.
    Cached per mesh object (meshes live as long as the job)."""
    if not widen:
        return mesh.mesh.cpu().numpy().astype(np.int64), False
    hit = _mesh_cache.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        return hit[1], hit[2]
    sub = mesh.mesh.cpu().numpy().astype(np.int64)
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    out = (sub, False)
    if root is not mesh:
        full = expand_submesh(root.mesh.cpu().numpy().astype(np.int64), sub)
        if len(full) > 1:
            out = (full, True)
    if len(_mesh_cache) > 256:
        _mesh_cache.clear()
    _mesh_cache[id(mesh)] = (mesh, *out)
    return out


# (id(mesh), placements, their types, shape, itemsize, widen) -> (mesh, layout, description,
# widened): the layouts of a state's many leaves repeat, and tensor_layout's own cache key
# costs more to build.
_layouts: dict[tuple[Any, ...], tuple[Any, TensorLayout, dict[str, Any], bool]] = {}


def dtensor_layout(value: Any, itemsize: int, leaf: str = "?") -> TensorLayout:
    return _dtensor_entry(value, itemsize, leaf)[1]


def _dtensor_entry(
    value: Any, itemsize: int, leaf: str | Path, widen: bool = True
) -> tuple[Any, TensorLayout, dict[str, Any], bool]:
    """(mesh, layout, description, widened) of a DTensor; `leaf` (its name or path) for
    errors; `widen`: see mesh_ranks."""
    mesh = value.device_mesh
    placements = value.placements
    # The types too: a placement may compare equal to one of a subclass (_StridedShard).
    key = (id(mesh), placements, tuple(map(type, placements)), value.shape, itemsize, widen)
    hit = _layouts.get(key)
    if hit is not None and hit[0] is mesh:
        return hit
    specs = placement_specs(placements, leaf if isinstance(leaf, str) else path_str(leaf))
    ranks, widened = mesh_ranks(mesh, widen)
    if widened:
        specs = [None, *specs]
    tl = tensor_layout(tuple(value.shape), itemsize, ranks, specs)
    if len(_layouts) > 4096:
        _layouts.clear()
    hit = _layouts[key] = (mesh, tl, describe(value), widened)
    return hit


_described: dict[int, tuple[Any, dict[Any, dict[str, Any]]]] = {}
_plain: dict[str, dict[str, Any]] = {}  # device type -> description of a plain tensor


def describe(value: Any) -> dict[str, Any]:
    """A JSON description of where a leaf lived, for people and `metadata` (never read back).
    Cached per mesh and placements; the same dict is shared, and nobody changes it."""
    if not is_dtensor(value):
        kind = value.device.type
        plain = _plain.get(kind)
        if plain is None:
            plain = _plain[kind] = {"type": "torch.Tensor", "device": kind}
        return plain
    mesh = value.device_mesh
    hit = _described.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        if len(_described) > 256:
            _described.clear()
        hit = _described[id(mesh)] = (mesh, {})
    placements = tuple(value.placements)
    desc = hit[1].get(placements)
    if desc is None:
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        desc = hit[1][placements] = {
            "type": "DTensor",
            "mesh": {str(n): int(s) for n, s in zip(names, mesh.shape, strict=True)},
            "placements": [str(p) for p in placements],
            "device": mesh.device_type,
        }
    return desc


@dataclass(eq=False)
class TorchSource(ReplicatedSource):
    """What a torch leaf's rows are read from: the local tensor (the DTensor's shard on this
    rank, or the whole tensor) and where each layout row starts in it."""

    local: torch.Tensor
    local_starts: np.ndarray | None  # (rows, ndim); None: rows are global boxes of `local`
    copies_assumed: bool = False  # a DTensor on a sub-mesh, widened (mesh_ranks)

    def value_digest(self) -> int:
        """crc32c of a plain tensor's bytes (saving.ReplicatedSource), 0 for a DTensor's
        shard. A tensor off the CPU is copied to the host for it."""
        if self.local_starts is not None:
            return 0
        t = self.local.detach()
        view = host_view(t if t.device.type == "cpu" else t.cpu())
        if not view.flags.c_contiguous:
            view = np.ascontiguousarray(view)
        return crc32c(view.reshape(-1).view(np.uint8).data)

    @classmethod
    def copy_digests(cls, sources: list[ReplicatedSource]) -> list[int]:
        """The signs of sampled elements of each rank's shard (ReplicatedSource.
        copy_digests), picked where the shard lives: those off the CPU are gathered there and
        reach the host in one transfer, cut apart after it."""
        picked: list[Any] = []
        for s in sources:
            assert isinstance(s, TorchSource)
            t = s.local.detach()
            at = sample_indices(t.numel())
            if t.device.type == "cpu":
                view = host_view(t)
                if view.flags.c_contiguous:
                    picked.append(view.reshape(-1)[at])
                else:  # (not flattened: that would copy all of it)
                    picked.append(view[np.unravel_index(at, view.shape)])
            else:
                index = torch.from_numpy(at).to(t.device)
                picked.append(t.contiguous().view(-1)[index])
        by_device: dict[Any, list[int]] = {}
        for k, p in enumerate(picked):
            if isinstance(p, torch.Tensor):
                by_device.setdefault(p.device, []).append(k)
        for ks in by_device.values():
            parts = [picked[k].view(torch.uint8) for k in ks]
            host = torch.cat(parts).cpu().split([len(q) for q in parts])
            for k, h in zip(ks, host, strict=True):
                picked[k] = h.numpy().view(numpy_dtype(picked[k].dtype))
        return [signs(p) for p in picked]


def classify(
    path: Path, value: Any, process_count: int, rank: int | None = None, trees_differ: bool = False
) -> SaveArray | ValueLeaf:
    """The leaf `value` at `path` is saved as (`rank`: this process's, found when None;
    `trees_differ`: the ranks' state dicts may differ, SaveOptions.trees_differ)."""
    if isinstance(value, torch.Tensor):  # first: nearly every leaf of a state dict
        rank = this_rank() if rank is None else rank
        return _tensor_leaf(path, value, process_count, rank, trees_differ)
    name = path_str(path)
    if isinstance(value, VALUE_TYPES) and not isinstance(value, np.generic):
        return ValueLeaf(path, value)
    if isinstance(value, PerProcess):
        return PerProcessLeaf(path, checked(host_values(value.value, name), name))
    if isinstance(value, NOT_STATE):
        raise not_state(value, name)
    from ..saving.save_array import classify as classify_numpy

    if isinstance(value, np.ndarray | np.generic):
        arr = classify_numpy(path, value, process_count)
        if trees_differ and isinstance(arr, SaveArray):
            rank = this_rank() if rank is None else rank
            arr.layout = own_layout(arr.shape, arr.dtype.itemsize, rank)
        return arr
    raise UnsupportedLeafError(
        f"leaf {name!r}: values of type {type(value).__module__}.{type(value).__qualname__} "
        "cannot be saved"
    )


def _tensor_leaf(
    path: Path, value: torch.Tensor, process_count: int, rank: int, trees_differ: bool
) -> SaveArray:
    """A tensor or DTensor leaf; the leaf's name is made only for an error (100,000 leaves
    would pay for their names twice). In a save of differing trees a plain tensor is held by this
    rank alone, as far as any rank can tell."""
    dt = TO_NUMPY.get(value.dtype)
    if dt is None:
        dt = numpy_dtype(value.dtype, leaf=path_str(path))  # raises, naming the leaf
    shape = tuple(value.shape)
    dtensor = is_dtensor(value)
    local = local_tensor(value) if dtensor else value
    why = unstorable(local)
    if why is not None:
        raise UnsupportedLeafError(f"leaf {path_str(path)!r} is {why}")
    if not dtensor:
        if value.is_meta:
            refuse_meta(value, path_str(path))
        if trees_differ:
            layout = own_layout(shape, dt.itemsize, rank)
        else:
            layout = host_layout(shape, dt.itemsize, process_count)
        source = TorchSource(value, None)
        return SaveArray(path, LeafKind.ARRAY, dt, shape, layout, None, source, describe(value))
    if value.is_meta or local.is_meta:
        refuse_meta(value, path_str(path))
    _, tl, desc, widened = _dtensor_entry(value, dt.itemsize, path, widen=not trees_differ)
    if len(tl.rows_of(rank)) and tuple(local.shape) != tl.local_shape(rank):
        raise UnsupportedLeafError(
            f"leaf {path_str(path)!r}: rank {rank}'s local tensor has shape "
            f"{tuple(local.shape)}, its mesh and placements say {tl.local_shape(rank)}"
        )
    source = TorchSource(local, tl.local_starts, copies_assumed=widened)
    return SaveArray(path, LeafKind.ARRAY, dt, shape, tl.layout, None, source, desc)


def this_rank() -> int:
    """This process's rank in the default process group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def row_slices(arr: SaveArray, row: int, start: np.ndarray, stop: np.ndarray) -> tuple[slice, ...]:
    """Box [start, stop) (inside layout row `row`) as slices of the leaf's local tensor."""
    src = arr.source
    if isinstance(src, TorchSource) and src.local_starts is not None:
        origin = arr.layout.starts[row] - src.local_starts[row]
    else:
        origin = np.zeros_like(start)
    return tuple(slice(int(a), int(b)) for a, b in zip(start - origin, stop - origin, strict=True))
