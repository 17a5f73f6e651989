"""PyTorch DCP's storage reader over snapshard checkpoints: `dcp.load(state,
storage_reader=snapshard.torch.StorageReader(path))` reads any snapshard checkpoint (one
written by `dcp.save` through snapshard.torch.StorageWriter, by snapshard.torch.save or by
snapshard.save), through snapshard's read executor: each rank reads the byte runs of its
own read items, verifying every checksum block they touch.

DCP's `Metadata` is reconstructed from the manifest, no pickle involved: each array leaf is
a tensor entry named by its path joined with '.' (DCP's flattened names), its chunks the
boxes of the layout it was saved with; Python values, containers holding only values (an
optimizer's `betas` tuple, as snapshard.torch.save stores it: one leaf per element) and DCP's
pickled bytes are `BYTE_IO` entries. Values are handed to DCP's planner as `torch.save`
bytes of the value; DCP's own pickles as they were written (DCP's planner unpickles them).
Per-process values (snapshard.PerProcess) and dtypes torch lacks (int4, ...) are not listed.

Where `ReadOptions.read_once` says so (by default on object stores and network
filesystems), a box several ranks' plans read is read by one and broadcast to the others
(torch/read_once.py).
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as _DcpStorageReader
from torch.futures import Future

from ..coordination.rendezvous import Rendezvous, namespace
from ..dtypes import dtype_from_name
from ..errors import CorruptCheckpointError, SnapshardError
from ..format import ArrayLeaf, Manifest, ValueLeaf
from ..format.kinds import LeafKind
from ..format.leaves import PerProcessLeaf
from ..options import ReadOptions, require
from ..planning.read_once import BoxKey, DcpReadOncePlan, plan_dcp
from ..reading import Dest, ReadDests, ReadStats, SavedBoxes, aligned_empty, fill
from ..reading.read_once_policy import too_small, wanted_here
from ..reading.sources import open_checkpoint
from ..storage import Location, storage_for
from ..tree import JsonNode, Path, unflatten
from .coordination import default_coordinator
from .dcp_manifest import PICKLED_KEY, DcpStorageError
from .dtypes import from_numpy, host_view, torch_dtype
from .read_once import backend_devices, broadcast_device, share_dcp


def dcp_name(path: Path) -> str:
    """The name DCP's flattening gives the state dict entry at `path`."""
    return ".".join(str(k) for k in path)


def _value_containers(manifest: Manifest) -> dict[str, JsonNode]:
    """The tree's containers whose leaves are all plain values, by DCP name: DCP keeps a
    tuple or list of values as one entry where snapshard stores one leaf per element."""
    out: dict[str, JsonNode] = {}
    _plain_values(manifest.structure, (), manifest, out)
    return out


def _plain_values(node: JsonNode, path: Path, manifest: Manifest, out: dict[str, JsonNode]) -> bool:
    """Whether every leaf under `node` is a plain value; such containers added to `out`."""
    if node["t"] == "leaf":
        leaf = manifest.leaves[int(node["i"])]
        return isinstance(leaf, ValueLeaf) and not isinstance(leaf, PerProcessLeaf)
    keys = node.get("k", range(len(node.get("c", []))))
    children = zip(keys, node.get("c", []), strict=True)
    plain = [_plain_values(child, (*path, k), manifest, out) for k, child in children]
    if path and all(plain):
        out[dcp_name(path)] = node
    return all(plain)


class _Entries:
    """What a checkpoint offers DCP: arrays, values and value containers by DCP name."""

    def __init__(self, manifest: Manifest, url: str, saved_boxes: SavedBoxes) -> None:
        self.manifest = manifest
        self.saved_boxes = saved_boxes
        self.pickled = set(manifest.extra.get(PICKLED_KEY, {}).get("pickled", []))
        self.arrays: dict[str, ArrayLeaf] = {}
        self.values: dict[str, Any] = {}
        for leaf in manifest.leaves:
            name = dcp_name(leaf.path)
            if isinstance(leaf, ArrayLeaf):
                self.arrays[name] = leaf
            elif not isinstance(leaf, PerProcessLeaf):
                self.values[name] = leaf.value
        for name, node in _value_containers(manifest).items():
            if name not in self.arrays:
                self.values.setdefault(name, unflatten(node, lambda i: manifest.leaves[i].value))  # type: ignore[union-attr]
        self.url = url

    def is_pickled(self, leaf: ArrayLeaf) -> bool:
        return "/".join(str(k) for k in leaf.path) in self.pickled

    def metadata(self) -> Metadata:
        md: dict[str, Any] = {}
        for name, leaf in self.arrays.items():
            if self.is_pickled(leaf):
                md[name] = BytesStorageMetadata()
                continue
            dt = torch_dtype(dtype_from_name(leaf.dtype))
            if dt is None or leaf.kind == LeafKind.PRNG_KEY:
                continue  # torch has no such dtype: not offered to DCP
            md[name] = TensorStorageMetadata(
                TensorProperties(dtype=dt), torch.Size(leaf.shape), self._chunks(leaf)
            )
        for name in self.values:
            md.setdefault(name, BytesStorageMetadata())
        paths = {dcp_name(leaf.path): leaf.path for leaf in self.manifest.leaves}
        return Metadata(md, planner_data=paths, storage_meta=StorageMeta(checkpoint_id=self.url))

    def _chunks(self, leaf: ArrayLeaf) -> list[ChunkStorageMetadata]:
        """The boxes the array was saved in (whole where the manifest does not say)."""
        boxes = self.saved_boxes(leaf)
        if boxes is None:
            return [ChunkStorageMetadata(torch.Size([0] * len(leaf.shape)), torch.Size(leaf.shape))]
        return [
            ChunkStorageMetadata(torch.Size(s.tolist()), torch.Size((e - s).tolist()))
            for s, e in zip(*boxes, strict=True)
        ]


class _TensorRead:
    """One DCP read item of a tensor, a `Fill` (reading/fills.py): the saved box it reads
    and the target region, handed to the planner once filled."""

    def __init__(self, item: ReadItem, leaf: ArrayLeaf, planner: LoadPlanner) -> None:
        self.item, self.leaf, self.planner = item, leaf, planner
        self.key = _box_key(item)
        self.start = np.asarray(self.key[1], np.int64)
        self.stop = np.asarray(self.key[2], np.int64)
        self.dtype = dtype_from_name(leaf.dtype)
        self.target = planner.resolve_tensor(item)
        self.direct = self._direct()
        self.nbytes = int(np.prod(self.stop - self.start)) * self.dtype.itemsize
        self._staged: np.ndarray | None = None

    def _direct(self) -> np.ndarray | None:
        """The target's own memory as bytes, where the read can land there."""
        t = self.target.detach()
        if t.device.type != "cpu" or not t.is_contiguous() or torch_dtype(self.dtype) != t.dtype:
            return None
        return host_view(t).reshape(-1).view(np.uint8)

    @property
    def buffered(self) -> int:
        return 0 if self.direct is not None else self.nbytes

    def dests(self) -> list[Dest]:
        if not self.nbytes:
            return []
        buf = self.direct
        if buf is None:
            buf = self._staged = aligned_empty(self.nbytes)
        return [Dest(self.leaf, self.start, self.stop, buf)]

    def finish(self) -> None:
        if self._staged is not None:
            shape = tuple(int(x) for x in self.stop - self.start)
            data = from_numpy(self._staged.view(self.dtype).reshape(shape))
            assert data is not None  # only dtypes torch has are offered
            with torch.no_grad():
                self.target.copy_(data)
            self._staged = None
        self.planner.commit_tensor(self.item, self.target)


class StorageReader(_DcpStorageReader):
    """`torch.distributed.checkpoint.StorageReader` that reads a snapshard checkpoint:
    `dcp.load(state, storage_reader=snapshard.torch.StorageReader(path))`.

    `path`: a directory or object-store URL (or `checkpoint_id=` of `dcp.load`). `options`:
    `verify`, `threads`, `memory_budget` (the host bytes of read buffers held at once) and
    `max_gap` as for snapshard.torch.load, `read_once` and `timeout_s` as there: with
    read-once, a box several ranks' plans read is read by one and broadcast to the others
    (torch/read_once.py)."""

    def __init__(self, path: Location | None = None, options: ReadOptions = ReadOptions()):
        super().__init__()
        require(options, ReadOptions)
        self.path = os.fspath(path) if path is not None else None
        self.options = options
        self.stats = ReadStats()
        self.is_coordinator = False
        self._rank: int | None = None
        self._opened: tuple[_Entries, ReadDests] | None = None

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._opened = None
        self.stats = ReadStats()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            with storage_for(checkpoint_id) as storage:
                return storage.is_committed()
        except (ValueError, SnapshardError, ImportError):
            return False

    def __getstate__(self) -> dict[str, Any]:  # the open checkpoint stays in this process
        return {**self.__dict__, "_opened": None}

    def _open(self) -> tuple[_Entries, ReadDests]:
        if self._opened is None:
            if not self.path:
                raise ValueError(
                    "snapshard.torch.StorageReader needs a location: StorageReader(path), or "
                    "dcp.load(..., checkpoint_id=path)"
                )
            storage = storage_for(self.path)
            source, read = open_checkpoint(storage, self.options, self.stats)
            self._opened = (_Entries(source.manifest, storage.url, source.saved_boxes), read)
        return self._opened

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._open()[0].metadata()

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator
        self._rank = kwargs.get("rank")  # in DCP's process group (torch passes it from 2.6)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Tells the coordinator whether this rank would read once (see torch/read_once.py):
        the ranks agree through DCP's own gather of the plans, with no rendezvous of
        their own. Read-once moves boxes between the ranks of the default group, so a load
        over another `process_group` (a subgroup, `no_dist`) reads without it."""
        dist = torch.distributed
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return plan
        able = broadcast_device(backend_devices()) is not None and self._rank == dist.get_rank()
        once = able and wanted_here(self._open()[0].url, self.options.read_once)
        return dataclasses.replace(plan, storage_data=once)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """The coordinator's read-once plan, the same in every rank's plan (or none)."""
        whole = (
            torch.distributed.is_initialized() and len(plans) == torch.distributed.get_world_size()
        )
        if not whole or not all(p.storage_data is True for p in plans):
            return [dataclasses.replace(p, storage_data=None) for p in plans]
        entries = self._open()[0]

        def nbytes(key: BoxKey) -> int:
            size = dtype_from_name(entries.arrays[key[0]].dtype).itemsize
            return int(np.prod(np.subtract(key[2], key[1]))) * size

        def large(key: BoxKey) -> bool:  # (the others: read by every holder)
            return not too_small(entries.arrays[key[0]].nbytes, self.options.read_once)

        keys = [
            [k for item in p.items if item.type != LoadItemType.BYTE_IO
             if large(k := _box_key(item))]
            for p in plans
        ]  # fmt: skip
        once = plan_dcp(keys, nbytes)
        return [dataclasses.replace(p, storage_data=once) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        entries, read = self._open()
        tensors, pickled = self._items(plan, planner, entries)
        for item, leaf in pickled:
            planner.load_bytes(item, io.BytesIO(_stored_bytes(read, leaf)))
        once = plan.storage_data if isinstance(plan.storage_data, DcpReadOncePlan) else None
        if once is None:
            fill(tensors, read, self.stats, budget=self.options.memory_budget)
        else:
            self._read_once(once, tensors, read, planner, entries.url)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _items(
        self, plan: LoadPlan, planner: LoadPlanner, entries: _Entries
    ) -> tuple[list[_TensorRead], list[tuple[ReadItem, ArrayLeaf]]]:
        """The plan's tensor reads and pickled entries; plain values handed over at once."""
        tensors: list[_TensorRead] = []
        pickled: list[tuple[ReadItem, ArrayLeaf]] = []
        for item in plan.items:
            name = item.storage_index.fqn
            leaf = entries.arrays.get(name)
            if item.type == LoadItemType.BYTE_IO:
                if leaf is not None and entries.is_pickled(leaf):
                    pickled.append((item, leaf))
                elif name in entries.values:
                    planner.load_bytes(item, _saved_bytes(entries.values[name]))
                else:
                    raise DcpStorageError(f"{entries.url}: no value {name!r} in the checkpoint")
            elif leaf is None:
                raise DcpStorageError(f"{entries.url}: no tensor {name!r} in the checkpoint")
            else:
                tensors.append(_TensorRead(item, leaf, planner))
        return tensors, pickled

    def _read_once(
        self,
        once: DcpReadOncePlan,
        tensors: list[_TensorRead],
        read: ReadDests,
        planner: LoadPlanner,
        url: str,
    ) -> None:
        coord = default_coordinator()
        rank = coord.process_index
        readers = {s.key: s.reader for s in once.shared}
        mine = [r for r in tensors if readers.get(r.key, rank) == rank]
        received = [r for r in tensors if readers.get(r.key, rank) != rank]
        # Taken in program order, the same on every rank.
        rv = Rendezvous(coord, namespace("load", url), f"dcp.load of {url}", self.options.timeout_s)
        error: BaseException | None = None
        try:
            fill(mine, read, self.stats, budget=self.options.memory_budget)
        except Exception as e:  # every rank learns of it in share(), which raises
            error = e
        regions: dict[BoxKey, list[torch.Tensor]] = {}
        for r in tensors:
            if r.key in readers:
                regions.setdefault(r.key, []).append(r.target)
        device = broadcast_device(backend_devices())
        assert device is not None  # prepare_local_plan wanted read-once only with one
        with torch.no_grad():
            self.stats.bytes_from_peers += share_dcp(once, rank, regions, rv, error, device)
        for r in received:
            planner.commit_tensor(r.item, r.target)


def _box_key(item: ReadItem) -> BoxKey:
    start = np.asarray(tuple(item.storage_index.offset or ()), np.int64) + np.asarray(
        tuple(item.storage_offsets), np.int64
    )
    stop = start + np.asarray(tuple(item.lengths), np.int64)
    return (item.storage_index.fqn, tuple(int(x) for x in start), tuple(int(x) for x in stop))


def _stored_bytes(read: ReadDests, leaf: ArrayLeaf) -> bytes:
    """The bytes of a uint8 leaf (DCP's pickled object), checked against their checksums."""
    buf = aligned_empty(leaf.nbytes)
    read([Dest(leaf, np.zeros(1, np.int64), np.asarray(leaf.shape, np.int64), buf)])
    return buf.tobytes()


def load_pickled(
    path: Location, *, trust_pickle: bool = False, options: ReadOptions = ReadOptions()
) -> dict[str, Any]:
    """The objects DCP pickled into a checkpoint written through StorageWriter (its
    `BYTE_IO` entries that are not plain values), by leaf name (`optim/param_groups/0/betas`),
    unpickled with torch.load. Unpickling runs whatever code the bytes name: it happens only
    with `trust_pickle=True`, for checkpoints from a source you trust; without it a
    checkpoint that holds such objects is refused, naming them."""
    require(options, ReadOptions)
    with storage_for(path) as storage:
        source, read = open_checkpoint(storage, options, ReadStats())
        manifest = source.manifest
        names = list(manifest.extra.get(PICKLED_KEY, {}).get("pickled", []))
        if names and not trust_pickle:
            shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
            raise DcpStorageError(
                f"{storage.url}: {len(names)} leaves hold objects DCP pickled ({shown}); "
                "pass trust_pickle=True to unpickle them, only for a checkpoint from a source "
                "you trust"
            )
        arrays = {leaf.name: leaf for leaf in manifest.arrays}
        out = {}
        for name in names:
            leaf = arrays.get(name)
            if leaf is None or leaf.dtype != "uint8" or len(leaf.shape) != 1:
                raise CorruptCheckpointError(
                    f"{storage.url}: leaf {name!r} is listed as pickled bytes but is no uint8 "
                    "array of one axis"
                )
            out[name] = torch.load(io.BytesIO(_stored_bytes(read, leaf)), weights_only=False)
        return out


def _saved_bytes(value: Any) -> io.BytesIO:
    """A stored value as DCP's planner expects a BYTE_IO entry: torch.save's bytes of it."""
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out
