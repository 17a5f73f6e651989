"""Read checkpoints written by orbax-checkpoint, through TensorStore (the `orbax` extra).

Supported: PyTree items (StandardCheckpointer / PyTreeCheckpointer directories) in the OCDBT
layout and the older one-directory-per-array layout, with zarr v2 or zarr3 arrays, and
CheckpointManager step directories (one item: that item's tree; several: a dict of them).
Orbax's JSON metadata gives the tree; TensorStore opens each array and reads boxes of it, so
a restore reads only the boxes the target needs, and leaves the target omits are never read.
Orbax's Python API is not used.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from ..dtypes import dtype_name
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, SnapshardError
from ..format import ArrayLeaf, ChunkTable, Leaf, Manifest, ValueLeaf
from ..format.kinds import LeafKind
from ..reading import chunk_boxes
from ..storage.location import local_path, parse_location
from ..tree import JsonNode, Path, path_str
from .meta import (
    ARRAY_METADATAS,
    ARRAY_TYPES,
    CHECKPOINT_METADATA,
    NONE_TYPE,
    SCALAR_TYPE,
    SHARDING,
    STRING_TYPE,
    STRINGS,
    TREE_METADATA,
    OrbaxEntry,
    commit_time,
    load_json,
    parse_key_impls,
    parse_shardings,
    parse_tree_metadata,
    step_item_names,
    step_order,
)

if TYPE_CHECKING:
    from ..reading import Dest, ReadStats

FORMAT = "orbax"
# Decoded chunks and OCDBT b-tree nodes cached by TensorStore: bounded, and enough to keep a
# chunk read by several boxes of a restore from being fetched and decompressed again.
_CACHE_BYTES = 64 << 20
# The single file (a msgpack map) of checkpoints written by very old Orbax versions.
_MSGPACK_CHECKPOINT = "checkpoint"
# Above this many zarr chunks an array's chunk grid is described as one box.
_MAX_GRID = 1 << 20


def kvstore_spec(location: str) -> dict[str, Any]:
    """The TensorStore key-value store of a directory: a local path, file://, s3:// or gs://."""
    parsed = parse_location(location)
    if parsed.local_path is not None:
        return {"driver": "file", "path": os.path.abspath(parsed.local_path).rstrip("/") + "/"}
    prefix = parsed.path + "/" if parsed.path else ""
    if parsed.scheme == "gs":
        return {"driver": "gcs", "bucket": parsed.bucket, "path": prefix}
    if parsed.scheme == "s3":
        spec: dict[str, Any] = {"driver": "s3", "bucket": parsed.bucket, "path": prefix}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        return spec
    raise SnapshardError(f"{location}: Orbax checkpoints are read from local paths, s3:// or gs://")


class _Dir:
    """A directory of a key-value store, for small metadata reads."""

    def __init__(self, spec: dict[str, Any], context: ts.Context, where: str):
        self.spec, self.context, self.where = spec, context, where
        try:
            self.kv = ts.KvStore.open(spec, context=context).result()
        except ValueError as e:
            raise SnapshardError(f"{where}: cannot open ({e})") from None

    def sub(self, name: str) -> _Dir:
        return _Dir(
            {**self.spec, "path": self.spec["path"] + name + "/"},
            self.context,
            f"{self.where}/{name}",
        )

    def read(self, key: str) -> bytes | None:
        try:
            r = self.kv.read(key).result()
        except ValueError as e:
            raise SnapshardError(f"{self.where}/{key}: cannot read ({e})") from None
        return bytes(r.value) if r.state == "value" else None

    def json(self, key: str) -> Any:
        data = self.read(key)
        return None if data is None else load_json(data, f"{self.where}/{key}")


@dataclass
class _Item:
    """One Orbax PyTree item, opened: its tree, its leaves and the TensorStore of each array."""

    structure: JsonNode
    leaves: list[Leaf]
    arrays: dict[Path, ts.TensorStore]
    process_count: int
    layout: str


class OrbaxCheckpoint:
    """An Orbax checkpoint opened for reading.

    `manifest` is its tree in snapshard's form: ArrayLeaf for arrays (their `chunks` are the
    boxes of the zarr chunk grid; bytes are located by TensorStore, so file and offset are
    unused), ValueLeaf for scalars, strings and None, which are read when opening.
    """

    format = FORMAT

    def __init__(self, url: str, manifest: Manifest, arrays: dict[Path, ts.TensorStore]):
        self.url, self.manifest, self._arrays = url, manifest, arrays

    def saved_boxes(self, leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
        """The boxes of the zarr chunk grid (the layout the writers held)."""
        return chunk_boxes(leaf)

    def read_dests(self, dests: list[Dest], stats: ReadStats) -> None:
        """Fill every destination box with one TensorStore read each."""
        pending = []
        for d in dests:
            store = self._arrays[d.leaf.path]
            box = tuple(slice(int(a), int(b)) for a, b in zip(d.start, d.stop, strict=True))
            pending.append((d, store[box].read() if box else store.read()))
        for d, future in pending:
            try:
                data = np.ascontiguousarray(future.result())
            except ValueError as e:
                raise CorruptCheckpointError(
                    f"{self.url}: cannot read leaf {d.leaf.name!r} box "
                    f"{d.start.tolist()}..{d.stop.tolist()} ({e})"
                ) from None
            # The TensorStore result becomes the destination buffer: no copy.
            d.buf = data.reshape(-1).view(np.uint8)
            stats.bytes_needed += d.buf.nbytes
            stats.bytes_read += d.buf.nbytes
            stats.reads += 1


def chunk_grid(shape: tuple[int, ...], chunk: tuple[int, ...] | None, itemsize: int) -> ChunkTable:
    """The boxes of a regular chunk grid over `shape`, as a chunk table without byte positions."""
    nd = len(shape)
    if math.prod(shape) == 0:
        return ChunkTable.empty(nd)
    chunk = tuple(int(c) for c in chunk) if chunk and len(chunk) == nd else shape
    counts = [-(-s // max(c, 1)) for s, c in zip(shape, chunk, strict=True)]
    if nd == 0 or math.prod(counts) > _MAX_GRID:
        starts = np.zeros((1, nd), np.int64)
        stops = np.asarray([shape], np.int64).reshape(1, nd)
    else:
        grid = np.indices(counts, dtype=np.int64).reshape(nd, -1).T
        starts = grid * np.asarray(chunk, np.int64)
        stops = np.minimum(starts + np.asarray(chunk, np.int64), np.asarray(shape, np.int64))
    n = len(starts)
    nbytes = np.prod(stops - starts, axis=1, dtype=np.int64) * itemsize
    zeros = np.zeros(n, np.int64)
    return ChunkTable(starts, stops, zeros, zeros, nbytes, zeros, [""] * n)


def _shift(node: JsonNode, offset: int) -> JsonNode:
    if node["t"] == "leaf":
        return {"t": "leaf", "i": int(node["i"]) + offset}
    return {**node, "c": [_shift(c, offset) for c in node.get("c", [])]}


def _open_arrays(
    item: _Dir, entries: list[OrbaxEntry], doc: dict[str, Any]
) -> tuple[dict[OrbaxEntry, Any], str]:
    """Start opening the zarr array of every array and scalar leaf (futures); the layout's name."""
    wanted = [e for e in entries if e.value_type in (*ARRAY_TYPES, SCALAR_TYPE)]
    if not wanted:
        return {}, "empty"
    use_ocdbt = doc.get("use_ocdbt")
    if use_ocdbt is None:
        use_ocdbt = item.read("manifest.ocdbt") is not None
    if use_ocdbt:
        base = {"driver": "ocdbt", "base": item.spec}
        kvstores = {e: {**base, "path": e.param + "/"} for e in wanted}
    else:
        kvstores = {e: {**item.spec, "path": item.spec["path"] + e.param + "/"} for e in wanted}
    use_zarr3 = doc.get("use_zarr3")
    if use_zarr3 is None:  # older metadata does not say: look at the first array
        probe = ts.KvStore.open(kvstores[wanted[0]], context=item.context).result()
        use_zarr3 = probe.read("zarr.json").result().state == "value"
    driver = "zarr3" if use_zarr3 else "zarr"
    futures = {
        e: ts.open(
            # A chunk missing from storage is an error, as Orbax reads it, not zeros
            {"driver": driver, "kvstore": kvstores[e], "fill_missing_data_reads": False},
            context=item.context,
            open=True,
            read=True,
        )
        for e in wanted
    }
    return futures, ("OCDBT " if use_ocdbt else "") + driver


def _load_item(item: _Dir, prefix: Path) -> _Item:
    where = item.where
    doc = item.json(TREE_METADATA)
    structure, entries = parse_tree_metadata(doc, f"{where}/{TREE_METADATA}")
    sharding_bytes = item.read(SHARDING)
    shardings = parse_shardings(sharding_bytes, f"{where}/{SHARDING}") if sharding_bytes else {}
    strings = item.json(STRINGS) or {}
    key_impls: dict[str, str] = {}
    process_count = 0
    while (meta := item.read(f"{ARRAY_METADATAS}/process_{process_count}")) is not None:
        key_impls.update(parse_key_impls(meta, f"{where}/{ARRAY_METADATAS}"))
        process_count += 1
    futures, layout = _open_arrays(item, entries, doc)
    stores: dict[OrbaxEntry, Any] = {}
    for e, f in futures.items():
        try:
            stores[e] = f.result()
        except ValueError as err:
            raise CorruptCheckpointError(
                f"{where}: cannot open the array of leaf {e.name!r} ({err})"
            ) from None
    scalars = {e: stores[e].read() for e in entries if e.value_type == SCALAR_TYPE}
    leaves: list[Leaf] = []
    arrays: dict[Path, ts.TensorStore] = {}
    for e in entries:
        path = (*prefix, *e.path)
        if e.value_type in ARRAY_TYPES:
            sharding = {"type": "host"} if e.value_type == "np.ndarray" else shardings.get(e.param)
            leaves.append(_array_leaf(path, stores[e], key_impls.get(e.param), sharding))
            arrays[path] = stores[e]
        else:
            leaves.append(
                _value_leaf(e, path, scalars.get(e), strings, f"{where}, leaf {path_str(path)!r}")
            )
    return _Item(structure, leaves, arrays, max(process_count, 1), layout)


def _array_leaf(
    path: Path, store: Any, key_impl: str | None, sharding: dict[str, Any] | None
) -> ArrayLeaf:
    """The leaf of an array read through TensorStore (its chunks: the zarr chunk grid)."""
    shape = tuple(int(s) for s in store.shape)
    np_dtype = np.dtype(store.dtype.numpy_dtype)
    return ArrayLeaf(
        path=path,
        kind=LeafKind.PRNG_KEY if key_impl else LeafKind.ARRAY,
        dtype=dtype_name(np_dtype, leaf=path_str(path)),
        shape=shape,
        sharding=sharding,
        key_impl=key_impl,
        chunks=chunk_grid(shape, store.chunk_layout.write_chunk.shape, np_dtype.itemsize),
    )


def _value_leaf(e: OrbaxEntry, path: Path, scalar: Any, strings: Any, name: str) -> ValueLeaf:
    """The leaf of a scalar (its read pending in `scalar`), a string or None."""
    if e.value_type == SCALAR_TYPE:
        try:
            return ValueLeaf(path, np.asarray(scalar.result()).item())
        except ValueError as err:
            raise CorruptCheckpointError(f"{name}: cannot read the scalar ({err})") from None
    if e.value_type == STRING_TYPE:
        if not isinstance(strings, dict) or not isinstance(strings.get(e.param), str):
            raise CorruptCheckpointError(f"{name}: the string is missing from {STRINGS}")
        return ValueLeaf(path, strings[e.param])
    if e.value_type == NONE_TYPE:
        return ValueLeaf(path, None)
    raise SnapshardError(
        f"{name}: values of Orbax type {e.value_type!r} (a custom type handler) cannot be read"
    )


def _item_names(root: _Dir, location: str, meta: Any) -> list[str]:
    names = step_item_names(meta)
    path = local_path(location)
    if names is None and path is not None and os.path.isdir(path):
        # Steps written before `_CHECKPOINT_METADATA` existed: look for item directories.
        names = sorted(e.name for e in os.scandir(path) if e.is_dir())
    return [n for n in names or [] if root.sub(n).read(TREE_METADATA) is not None]


def _manager_steps(location: str) -> list[str]:
    """Step directories below a local CheckpointManager directory (for a helpful error)."""
    path = local_path(location)
    if path is None or not os.path.isdir(path):
        return []
    return sorted(
        (
            e.name
            for e in os.scandir(path)
            if os.path.isfile(os.path.join(e.path, CHECKPOINT_METADATA))
        ),
        key=step_order,
    )


def open_orbax(location: str) -> OrbaxCheckpoint | None:
    """The Orbax checkpoint at `location`, or None when there is none."""
    context = ts.Context({"cache_pool": {"total_bytes_limit": _CACHE_BYTES}})
    try:
        root = _Dir(kvstore_spec(location), context, location.rstrip("/"))
        has_tree = root.read(TREE_METADATA) is not None
    except SnapshardError:  # nothing readable there, so no Orbax checkpoint either
        return None
    meta = root.json(CHECKPOINT_METADATA)
    if has_tree:
        named: list[tuple[str | None, _Dir]] = [(None, root)]
    else:
        named = [(n, root.sub(n)) for n in _item_names(root, location, meta)]
    if not named:
        old = root.read(_MSGPACK_CHECKPOINT) if meta is None else None
        if old is not None and old[:1] and (0x80 <= old[0] <= 0x8F or old[0] in (0xDE, 0xDF)):
            raise SnapshardError(
                f"{location} is an Orbax checkpoint from before Orbax wrote {TREE_METADATA} "
                "(a msgpack 'checkpoint' file), which this library does not read"
            )
        steps = _manager_steps(location)
        if steps:
            raise CheckpointNotFoundError(
                f"{location} is an Orbax CheckpointManager directory; pass one of its steps "
                f"({', '.join(steps[:8])}{', …' if len(steps) > 8 else ''})"
            )
        return None
    items = [(n, _load_item(d, () if n is None or len(named) == 1 else (n,))) for n, d in named]
    if len(items) == 1:
        structure, leaves = items[0][1].structure, items[0][1].leaves
    else:
        children, leaves = [], []
        for _, it in items:
            children.append(_shift(it.structure, len(leaves)))
            leaves.extend(it.leaves)
        structure = {"t": "dict", "k": [n for n, _ in items], "c": children}
    arrays = {p: s for _, it in items for p, s in it.arrays.items()}
    manifest = Manifest(
        structure=structure,
        leaves=leaves,
        files=[],
        process_count=max(it.process_count for _, it in items),
        write_mode=FORMAT,
        created_unix=commit_time(meta) or 0.0,
        extra={
            "format": FORMAT,
            "layout": items[0][1].layout,
            "items": [n for n, _ in items if n is not None],
        },
    )
    return OrbaxCheckpoint(location, manifest, arrays)


def step_info(location: str) -> tuple[bool, float | None]:
    """Whether an Orbax checkpoint or step is at `location`, and when it was committed (None:
    not committed). Reads `_CHECKPOINT_METADATA` only, for listings."""
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    try:
        root = _Dir(kvstore_spec(location), context, location.rstrip("/"))
        meta = root.json(CHECKPOINT_METADATA)
        if meta is None:
            return root.read(TREE_METADATA) is not None, None
    except SnapshardError:
        return False, None
    return True, commit_time(meta)
