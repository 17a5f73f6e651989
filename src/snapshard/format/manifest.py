"""Format v1: the manifest and the per-process index, as JSON. See docs/format.md.

The manifest is the only thing a reader trusts: it lists every leaf of the tree, and for each
array every chunk with its box, file, byte offset, length and crc32c checksums (one per
checksum block of the chunk).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from ..tree import JsonNode, Path, path_str

FORMAT_NAME = "snapshard"
INDEX_FORMAT_NAME = "snapshard-index"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
INDEX_DIR = "index"
MIN_CHECKSUM_BLOCK = 4 << 10
MAX_BLOCKS_PER_CHUNK = 256
_SAFE_NAME = re.compile(r"^(data|index)/[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")

ARRAY_KINDS = ("array", "scalar", "prng_key")


def checksum_block(nbytes: int) -> int:
    """Bytes per checksum block of a chunk: at least 4 KiB, at most 256 blocks per chunk.

    Small blocks let a partial read verify what it reads without reading much more; the cap
    keeps the manifest small for large chunks.
    """
    if nbytes <= MIN_CHECKSUM_BLOCK:
        return max(nbytes, 1)
    per = -(-nbytes // MAX_BLOCKS_PER_CHUNK)
    return max(MIN_CHECKSUM_BLOCK, -(-per // 4096) * 4096)


def check_file_name(name: Any, where: str) -> str:
    """A data or index file name from a manifest, refusing anything that could leave the checkpoint."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise CorruptCheckpointError(f"{where}: unsafe or malformed file name {name!r}")
    return name


@dataclass
class ChunkTable:
    """The chunks of one array, column by column."""

    starts: np.ndarray  # (C, ndim) int64
    stops: np.ndarray  # (C, ndim) int64
    file: np.ndarray  # (C,) index into the file list
    offset: np.ndarray  # (C,) byte offset in the file
    nbytes: np.ndarray  # (C,)
    block: np.ndarray  # (C,) checksum block size
    crc32c: list[str]  # (C,) hex, 8 digits per block

    @staticmethod
    def empty(ndim: int) -> ChunkTable:
        z = np.zeros(0, dtype=np.int64)
        return ChunkTable(
            np.zeros((0, ndim), np.int64), np.zeros((0, ndim), np.int64), z, z, z, z, []
        )

    def __len__(self) -> int:
        return len(self.nbytes)

    def block_crcs(self, i: int) -> np.ndarray:
        return np.frombuffer(bytes.fromhex(self.crc32c[i]), dtype=">u4").astype(np.uint32)

    # Whether chunk i is stored as exactly its box (a subclass may store a larger box).
    stores_own_boxes = True

    def storage_box(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The box whose C-order bytes chunk i stores. For manifest chunks it is the chunk's
        box; tables built by readers of other formats may store a larger box of which only
        [starts[i], stops[i]) belongs to the array (see snapshard.safetensors)."""
        return self.starts[i], self.stops[i]

    @staticmethod
    def from_rows(rows: list[dict[str, Any]], ndim: int, where: str) -> ChunkTable:
        if not rows:
            return ChunkTable.empty(ndim)
        try:
            starts = np.array([r["start"] for r in rows], dtype=np.int64).reshape(len(rows), ndim)
            stops = np.array([r["stop"] for r in rows], dtype=np.int64).reshape(len(rows), ndim)
            cols = {
                k: np.array([r[k] for r in rows], dtype=np.int64)
                for k in ("file", "offset", "nbytes", "block")
            }
            crcs = [str(r["crc32c"]) for r in rows]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed chunk entry ({e})") from None
        return ChunkTable(
            starts, stops, cols["file"], cols["offset"], cols["nbytes"], cols["block"], crcs
        )

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "start": self.starts[i].tolist(),
                "stop": self.stops[i].tolist(),
                "file": int(self.file[i]),
                "offset": int(self.offset[i]),
                "nbytes": int(self.nbytes[i]),
                "block": int(self.block[i]),
                "crc32c": self.crc32c[i],
            }
            for i in range(len(self))
        ]

    def sorted_by_box(self) -> ChunkTable:
        """The chunks in box order (start, lexicographically): arrays with the same chunk
        boxes then have equal box columns, which readers share (see intern_boxes)."""
        if len(self) < 2:
            return self
        o = np.lexsort(self.starts.T[::-1])
        return ChunkTable(
            self.starts[o], self.stops[o], self.file[o], self.offset[o], self.nbytes[o], self.block[o],
            [self.crc32c[i] for i in o.tolist()],
        )  # fmt: skip

    def intern_boxes(self, seen: dict[bytes, tuple[np.ndarray, np.ndarray]]) -> None:
        """Share the box columns with an earlier table of equal boxes (one index serves both)."""
        key = self.starts.tobytes() + b"|" + self.stops.tobytes()
        self.starts, self.stops = seen.setdefault(key, (self.starts, self.stops))

    @staticmethod
    def concat(tables: list[ChunkTable], ndim: int) -> ChunkTable:
        tables = [t for t in tables if len(t)]
        if not tables:
            return ChunkTable.empty(ndim)
        return ChunkTable(
            np.concatenate([t.starts for t in tables]),
            np.concatenate([t.stops for t in tables]),
            np.concatenate([t.file for t in tables]),
            np.concatenate([t.offset for t in tables]),
            np.concatenate([t.nbytes for t in tables]),
            np.concatenate([t.block for t in tables]),
            [c for t in tables for c in t.crc32c],
        )


@dataclass
class ArrayLeaf:
    """An array leaf: a jax.Array, np.ndarray, NumPy scalar ('scalar') or typed PRNG key."""

    path: Path
    kind: str
    dtype: str
    shape: tuple[int, ...]
    sharding: dict[str, Any] | None = None
    key_impl: str | None = None
    chunks: ChunkTable = field(default_factory=lambda: ChunkTable.empty(0))

    @property
    def name(self) -> str:
        return path_str(self.path)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The shape the user sees (a key array's stored shape has the key data axis)."""
        return self.shape[:-1] if self.kind == "prng_key" else self.shape

    @property
    def nbytes(self) -> int:
        from ..dtypes import dtype_from_name

        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclass
class ValueLeaf:
    """A Python value stored in the manifest itself: int, float, bool, str or None."""

    path: Path
    value: Any

    @property
    def name(self) -> str:
        return path_str(self.path)


Leaf = ArrayLeaf | ValueLeaf


def encode_value(v: Any, where: str) -> dict[str, Any]:
    if v is None:
        return {"type": "none"}
    if isinstance(v, bool):
        return {"type": "bool", "value": v}
    if isinstance(v, int):
        return {"type": "int", "value": str(v)}
    if isinstance(v, float):
        return {"type": "float", "value": v.hex()}
    if isinstance(v, str):
        return {"type": "str", "value": v}
    raise CorruptCheckpointError(f"{where}: cannot encode value {v!r}")


def decode_value(d: Any, where: str) -> Any:
    try:
        t = d["type"]
        if t == "none":
            return None
        if t == "bool":
            return bool(d["value"])
        if t == "int":
            return int(d["value"])
        if t == "float":
            return float.fromhex(d["value"])
        if t == "str":
            return str(d["value"])
    except (KeyError, TypeError, ValueError):
        pass
    raise CorruptCheckpointError(f"{where}: malformed value entry {d!r}")


def _path_from_json(p: Any, where: str) -> Path:
    if not isinstance(p, list) or not all(
        isinstance(k, str | int) and not isinstance(k, bool) for k in p
    ):
        raise CorruptCheckpointError(f"{where}: malformed leaf path {p!r}")
    return tuple(p)


def leaf_to_json(leaf: Leaf, chunks: bool = True) -> dict[str, Any]:
    if isinstance(leaf, ValueLeaf):
        return {
            "path": list(leaf.path),
            "kind": "value",
            "value": encode_value(leaf.value, leaf.name),
        }
    out: dict[str, Any] = {
        "path": list(leaf.path),
        "kind": leaf.kind,
        "dtype": leaf.dtype,
        "shape": list(leaf.shape),
        "sharding": leaf.sharding,
    }
    if leaf.key_impl is not None:
        out["key_impl"] = leaf.key_impl
    if chunks:
        out["chunks"] = leaf.chunks.rows()
    return out


def leaf_from_json(d: Any, where: str) -> Leaf:
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"{where}: malformed leaf entry")
    path = _path_from_json(d.get("path"), where)
    kind = d.get("kind")
    where = f"{where}, leaf {path_str(path)!r}"
    if kind == "value":
        return ValueLeaf(path, decode_value(d.get("value"), where))
    if kind not in ARRAY_KINDS:
        raise CorruptCheckpointError(f"{where}: unknown leaf kind {kind!r}")
    shape = d.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise CorruptCheckpointError(f"{where}: malformed shape {shape!r}")
    dtype = d.get("dtype")
    if not isinstance(dtype, str):
        raise CorruptCheckpointError(f"{where}: malformed dtype {dtype!r}")
    rows = d.get("chunks", [])
    if not isinstance(rows, list):
        raise CorruptCheckpointError(f"{where}: malformed chunk list")
    return ArrayLeaf(
        path=path,
        kind=kind,
        dtype=dtype,
        shape=tuple(shape),
        sharding=d.get("sharding"),
        key_impl=d.get("key_impl"),
        chunks=ChunkTable.from_rows(rows, len(shape), where),
    )


@dataclass
class FileEntry:
    name: str
    size: int


@dataclass
class Manifest:
    structure: JsonNode
    leaves: list[Leaf]
    files: list[FileEntry]
    process_count: int = 1
    write_mode: str = "auto"
    created_unix: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def arrays(self) -> list[ArrayLeaf]:
        return [leaf for leaf in self.leaves if isinstance(leaf, ArrayLeaf)]

    @property
    def total_bytes(self) -> int:
        return sum(int(a.chunks.nbytes.sum()) for a in self.arrays)

    def leaf_by_path(self) -> dict[Path, Leaf]:
        return {leaf.path: leaf for leaf in self.leaves}

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "created_unix": self.created_unix,
            "process_count": self.process_count,
            "write_mode": self.write_mode,
            "total_bytes": self.total_bytes,
            "files": [{"name": f.name, "size": f.size} for f in self.files],
            "tree": self.structure,
            "leaves": [leaf_to_json(leaf) for leaf in self.leaves],
            "extra": self.extra,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def from_json(data: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where}: not a snapshard manifest")
        version = doc.get("version")
        if version != FORMAT_VERSION:
            raise CorruptCheckpointError(
                f"{where}: manifest format version {version!r} is not supported (this library reads {FORMAT_VERSION})"
            )
        files_raw = doc.get("files")
        leaves_raw = doc.get("leaves")
        if not isinstance(files_raw, list) or not isinstance(leaves_raw, list):
            raise CorruptCheckpointError(f"{where}: manifest lacks its file or leaf list")
        files = []
        for f in files_raw:
            if not isinstance(f, dict) or not isinstance(f.get("size"), int):
                raise CorruptCheckpointError(f"{where}: malformed file entry {f!r}")
            files.append(FileEntry(check_file_name(f.get("name"), where), int(f["size"])))
        structure = doc.get("tree")
        if not isinstance(structure, dict):
            raise CorruptCheckpointError(f"{where}: manifest lacks the tree structure")
        return Manifest(
            structure=structure,
            leaves=_interned([leaf_from_json(d, where) for d in leaves_raw]),
            files=files,
            process_count=int(doc.get("process_count", 1)),
            write_mode=str(doc.get("write_mode", "auto")),
            created_unix=float(doc.get("created_unix", 0.0)),
            version=version,
            extra=doc.get("extra") or {},
        )


def _interned(leaves: list[Leaf]) -> list[Leaf]:
    seen: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
    for leaf in leaves:
        if isinstance(leaf, ArrayLeaf) and len(leaf.chunks):
            leaf.chunks.intern_boxes(seen)
    return leaves


@dataclass
class ProcessIndex:
    """What one process wrote: its files and, per leaf index, its chunks (file = local index)."""

    process: int
    files: list[FileEntry]
    chunks: dict[int, ChunkTable]

    def to_json(self) -> bytes:
        doc = {
            "format": INDEX_FORMAT_NAME,
            "version": FORMAT_VERSION,
            "process": self.process,
            "files": [{"name": f.name, "size": f.size} for f in self.files],
            "chunks": {str(i): t.rows() for i, t in self.chunks.items()},
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def from_json(data: bytes, where: str, ndims: dict[int, int]) -> ProcessIndex:
        try:
            doc = json.loads(data)
            if doc.get("format") != INDEX_FORMAT_NAME or doc.get("version") != FORMAT_VERSION:
                raise ValueError("not a snapshard v1 index")
            files = [
                FileEntry(check_file_name(f["name"], where), int(f["size"])) for f in doc["files"]
            ]
            chunks = {}
            for k, rows in doc["chunks"].items():
                i = int(k)
                if i not in ndims:
                    raise ValueError(f"chunks for unknown leaf {i}")
                chunks[i] = ChunkTable.from_rows(rows, ndims[i], where)
            return ProcessIndex(int(doc["process"]), files, chunks)
        except (KeyError, TypeError, ValueError, AttributeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: malformed process index ({e})") from None
