"""Converting a PyTorch DCP checkpoint (torch.distributed.checkpoint) into a snapshard one.

The DCP checkpoint is read through torch's own `FileSystemReader`: its `.metadata` file is a
Python pickle, and unpickling runs whatever code the file names, so nothing is read unless
the caller says it trusts the file (`trust_pickle=True`, `--trust-pickle` on the command
line). snapshard itself never writes or reads pickle; this is the one place a pickle is
read, by torch, on request. Non-tensor entries (DCP stores them as `torch.save` bytes) are
loaded with torch's restricted unpickler (`weights_only=True`), so they can only be plain
values; tensor chunks are loaded by torch's reader the same way.

Names: the leaves get the paths of the state dict given to `dcp.save` (DCP records them
as its planner data when it flattens the state dict, which it does by default), so
`snapshard.torch.load(dst, state_dict)` fills the same state dict; without that record each
DCP key is one top-level entry. Dtypes, shapes and bytes are those of the checkpoint.

Memory: each saved chunk (what one rank wrote of a tensor) is read, written out in slabs of
at most `chunk_bytes`, and dropped before the next one; so memory holds about two copies of
the largest saved chunk, never the whole tensor or the whole checkpoint.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import torch

from ..dtypes import dtype_name
from ..errors import SnapshardError, UnsupportedLeafError
from ..format import Manifest
from ..saving.box_writer import CheckpointWriter
from ..tree import FlatTree, Path, flatten, path_str
from .dtypes import host_view, numpy_dtype
from .leaves import is_leaf


class PickleRefusedError(SnapshardError):
    """A DCP checkpoint was to be read without the caller's trust in its pickled metadata."""


def refusal(location: str) -> PickleRefusedError:
    return PickleRefusedError(
        f"{location} is a PyTorch DCP checkpoint: its .metadata file is a Python pickle, and "
        "reading it runs any code the file names. Pass --trust-pickle (trust_pickle=True) "
        "only for a checkpoint from a source you trust. snapshard itself never writes or "
        "reads pickle; the converted checkpoint has none."
    )


@dataclass(eq=False)
class _Slot:
    """A tensor entry of the DCP checkpoint, in the tree being rebuilt."""

    key: str
    meta: Any  # TensorStorageMetadata


def _paths(metadata: Any) -> dict[str, Path]:
    """Each entry's path in the saved tree: DCP's planner data where it is one, else (key,)."""
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}

    def valid(p: Any) -> TypeGuard[Path]:
        return (
            isinstance(p, tuple)
            and bool(p)
            and all(isinstance(c, str | int) and not isinstance(c, bool) for c in p)
        )

    return {k: p if valid(p := mapping.get(k)) else (k,) for k in metadata.state_dict_metadata}


def _nest(entries: dict[Path, Any], where: Path = ()) -> Any:
    """Containers from paths: int keys 0..n-1 make a list, other keys a dict."""
    if () in entries:
        if len(entries) > 1:
            raise UnsupportedLeafError(
                f"DCP entry {path_str(where)!r} is both a value and the parent of others"
            )
        return entries[()]
    children: dict[Any, dict[Path, Any]] = {}
    for p, v in entries.items():
        children.setdefault(p[0], {})[p[1:]] = v
    keys = list(children)
    if all(isinstance(k, int) for k in keys) and sorted(keys) == list(range(len(keys))):
        return [_nest(children[i], (*where, i)) for i in range(len(keys))]
    if len({type(k) for k in keys}) > 1:
        raise UnsupportedLeafError(
            f"DCP entries under {path_str(where)!r} mix int and str keys: {keys[:6]}"
        )
    return {k: _nest(children[k], (*where, k)) for k in keys}


class _Planner:
    """The LoadPlanner torch's reader calls back: values are kept, tensor chunks are handed
    to `on_chunk` as they arrive (one at a time)."""

    def __init__(self, slots: dict[str, _Slot], on_chunk: Callable[[str, Any, torch.Tensor], None]):
        self.slots, self.on_chunk = slots, on_chunk
        self.values: dict[str, Any] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.values[key] = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            raise UnsupportedLeafError(
                f"DCP entry {key!r} is not a plain value torch's restricted loader accepts: {e}"
            ) from None

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        meta = self.slots[read_item.dest_index.fqn].meta
        return torch.empty(tuple(read_item.lengths), dtype=meta.properties.dtype)

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        self.on_chunk(read_item.dest_index.fqn, read_item.dest_offsets, tensor)


def _read_items(key: str, meta: Any) -> list[Any]:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    if isinstance(meta, BytesStorageMetadata):
        zero = torch.Size((0,))
        index = MetadataIndex(key)
        return [ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero)]
    out = []
    for chunk in meta.chunks:
        if math.prod(chunk.sizes) == 0:
            continue
        index = MetadataIndex(key, chunk.offsets)
        zeros = torch.Size([0] * len(chunk.sizes))
        out.append(ReadItem(LoadItemType.TENSOR, index, chunk.offsets, index, zeros, chunk.sizes))
    return out


def _read(reader: Any, items: list[Any], planner: _Planner) -> None:
    from torch.distributed.checkpoint.planner import LoadPlan

    if items:
        reader.read_data(LoadPlan(items), planner).wait()


def _slabs(data: np.ndarray, slab_bytes: int) -> list[tuple[int, int]]:
    """Row ranges of `data` (its leading axis) of at most `slab_bytes` (at least one row)."""
    if data.ndim == 0:
        return [(0, 0)]
    row = max(1, data.nbytes // max(1, data.shape[0]))
    rows = max(1, slab_bytes // row)
    return [(r, min(r + rows, data.shape[0])) for r in range(0, data.shape[0], rows)]


class DcpCheckpoint:
    """A DCP checkpoint opened through torch's FileSystemReader: its metadata and its
    (small) non-tensor values are read here, its tensors by `write_snapshard`. Refuses
    (PickleRefusedError) unless `trust_pickle`."""

    def __init__(self, location: str, *, trust_pickle: bool = False) -> None:
        if not trust_pickle:
            raise refusal(location)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.location = location
        self._reader = FileSystemReader(location)
        metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(metadata, True)
        paths = _paths(metadata)
        entries = metadata.state_dict_metadata
        self._slots = {
            k: _Slot(k, m) for k, m in entries.items() if isinstance(m, TensorStorageMetadata)
        }
        # The values first (small): they are part of the tree's structure.
        planner = _Planner(self._slots, lambda *_: None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.load's notes on weights_only
            items = [
                i for k, m in entries.items() if k not in self._slots for i in _read_items(k, m)
            ]
            _read(self._reader, items, planner)
        leaves = {paths[k]: self._slots.get(k) or planner.values[k] for k in entries}
        if len(leaves) != len(entries):
            raise UnsupportedLeafError(f"{location}: two DCP entries have the same path")
        self.tree = flatten(_nest(leaves), lambda x: isinstance(x, _Slot) or is_leaf(x))

    @property
    def entries(self) -> int:
        return len(self.tree.leaves)

    @property
    def tensors(self) -> int:
        return len(self._slots)

    @property
    def tensor_bytes(self) -> int:
        return sum(
            math.prod(m.meta.size) * m.meta.properties.dtype.itemsize for m in self._slots.values()
        )

    def write_snapshard(
        self,
        dst: Any,
        *,
        overwrite: bool = False,
        chunk_bytes: int = 256 << 20,
        progress: Callable[[int], None] | None = None,
    ) -> Manifest:
        """Write it as a snapshard checkpoint at `dst` (atomically; chunks of at most
        `chunk_bytes`); returns the manifest. `progress` is told the bytes of each slab."""
        writer = CheckpointWriter(dst, overwrite=overwrite, extra={"converted_from": "dcp"})
        try:
            index = _add_leaves(writer, self.tree)

            def on_chunk(key: str, offsets: Any, tensor: torch.Tensor) -> None:
                data = host_view(tensor)
                start = np.asarray(offsets, dtype=np.int64).reshape(data.ndim)
                for a, b in _slabs(data, chunk_bytes):
                    part = data[a:b] if data.ndim else data
                    lo = start.copy()
                    if data.ndim:
                        lo[0] += a
                    writer.write_box(index[key], lo, lo + np.asarray(part.shape, np.int64), part)
                    if progress is not None:
                        progress(part.nbytes)

            planner = _Planner(self._slots, on_chunk)
            items = [i for k, slot in self._slots.items() for i in _read_items(k, slot.meta)]
            _read(self._reader, items, planner)
            return writer.commit(self.tree.structure)
        except BaseException:
            writer.abort()
            raise
        finally:
            writer.close()


def _add_leaves(writer: CheckpointWriter, flat: FlatTree) -> dict[str, int]:
    """Every leaf of the converted tree declared to `writer`: DCP's tensors as arrays whose
    boxes come later (returns their array numbers by DCP key), tensors and arrays inside
    the values written at once, the other values as they are."""
    index: dict[str, int] = {}
    for path, leaf in zip(flat.paths, flat.leaves, strict=True):
        if isinstance(leaf, _Slot):
            dt = numpy_dtype(leaf.meta.properties.dtype, leaf=leaf.key)
            shape = tuple(int(s) for s in leaf.meta.size)
            index[leaf.key] = writer.add_array(
                path, kind="array", dtype=dtype_name(dt, leaf=leaf.key), shape=shape, sharding=None
            )
        elif isinstance(leaf, torch.Tensor | np.ndarray | np.generic):  # in a value
            data = np.asarray(
                host_view(leaf.contiguous()) if isinstance(leaf, torch.Tensor) else leaf
            )
            dtype = dtype_name(data.dtype, leaf=path_str(path))
            i = writer.add_array(path, kind="array", dtype=dtype, shape=data.shape, sharding=None)
            writer.write_box(i, (0,) * data.ndim, data.shape, data)
        else:
            writer.add_value(path, leaf)
    return index


def convert_dcp(
    src: str,
    dst: Any,
    *,
    trust_pickle: bool = False,
    overwrite: bool = False,
    chunk_bytes: int = 256 << 20,
) -> Manifest:
    """The DCP checkpoint at `src` as a snapshard checkpoint at `dst`; see DcpCheckpoint."""
    return DcpCheckpoint(src, trust_pickle=trust_pickle).write_snapshard(
        dst, overwrite=overwrite, chunk_bytes=chunk_bytes
    )
