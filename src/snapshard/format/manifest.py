"""The manifest: the one file every reader parses. See docs/format.md.

Format v2: the tree, per leaf its path, dtype, shape and layout, per distinct
layout a compact description (format.layouts), and per process its data files, its record
file and that file's checksum; nothing per chunk. Chunk records live in the per-process
record files (format.records) and checksums beside the data they cover. 2.1 (written)
binds every stored checksum to its file (format.binding); 2.0 (read) did not.

Format v1 (read): the same tree, with every chunk of every array inline as JSON, and
per-process JSON indexes that the committer merged.
"""

from __future__ import annotations

import base64
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checksum import crc32c
from ..dtypes import NAME_TO_DTYPE
from ..errors import CorruptCheckpointError
from ..tree import JsonNode, Path, path_str
from .binding import chunk_key, name_key

FORMAT_NAME = "snapshard"
INDEX_FORMAT_NAME = "snapshard-index"
FORMAT_VERSION = 2
# 2.1 binds every checksum to its file (format.binding). The manifest states it as the
# string "2.1": a reader of 2.0 refuses it by name instead of failing every checksum.
FORMAT_MINOR = 1
READ_VERSIONS: tuple[int | str, ...] = (1, 2, "2.1")
MANIFEST_NAME = "manifest.json"
DATA_DIR = "data"
INDEX_DIR = "index"
MIN_CHECKSUM_BLOCK = 4 << 10
MAX_BLOCKS_PER_CHUNK = 256
_SAFE_NAME = re.compile(r"(data|index)/[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
_NONCE = re.compile(r"[0-9a-f]{8}")
# Bounds checked before a reader allocates or reads anything a manifest implies.
MAX_DIM = 1 << 48
MAX_BYTES = 1 << 56
MAX_NDIM = 64
MAX_DEPTH = 256
MAX_PROCESSES = 1 << 20
MAX_FILES_PER_PROCESS = 4096
# The checksum of a v2 manifest is the crc32c of the file with its 8 digits as zeros.
CHECKSUM_KEY = b'"checksum":"'


def data_file_name(process: int, nonce: str, number: int) -> str:
    return f"{DATA_DIR}/p{process:05d}-{nonce}-{number}.bin"


def record_file_name(process: int, nonce: str) -> str:
    return f"{INDEX_DIR}/p{process:05d}-{nonce}.idx"


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
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
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
    crc32c: list[str]  # v1: (C,) hex, 8 digits per block; v2: empty
    # v2: where the chunk's crc32c values (uint32, one per block) lie in its file
    crc_offset: np.ndarray | None = None
    # v2: the record flags' codec bits per chunk (None: nothing compressed; see codecs.py)
    flags: np.ndarray | None = None
    # 2.1: the name key of every file of the manifest, by global file number, shared by
    # all its tables (format.binding; None: the checksums are not bound)
    file_keys: np.ndarray | None = None
    # v2: the records' checksum block counts (checked against nbytes and block)
    nblocks: np.ndarray | None = None

    @staticmethod
    def empty(ndim: int) -> ChunkTable:
        z = np.zeros(0, dtype=np.int64)
        return ChunkTable(
            np.zeros((0, ndim), np.int64), np.zeros((0, ndim), np.int64), z, z, z, z, [], z
        )

    def _take(self, o: np.ndarray) -> ChunkTable:
        return ChunkTable(
            self.starts[o], self.stops[o], self.file[o], self.offset[o], self.nbytes[o], self.block[o],
            [self.crc32c[i] for i in o.tolist()] if self.crc32c else [],
            None if self.crc_offset is None else self.crc_offset[o],
            None if self.flags is None else self.flags[o],
            self.file_keys,
            None if self.nblocks is None else self.nblocks[o],
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.nbytes)

    def block_crcs(self, i: int) -> np.ndarray:
        """v1 only: the checksums of chunk i, from the manifest (v2 keeps them in the file)."""
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
        except (KeyError, TypeError, ValueError, OverflowError) as e:
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
        return self._take(np.lexsort(self.starts.T[::-1]))

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
            None
            if any(t.crc_offset is None for t in tables)
            else np.concatenate([t.crc_offset for t in tables]),
            _concat_optional([t.flags for t in tables], [len(t) for t in tables]),
            next((t.file_keys for t in tables if t.file_keys is not None), None),
            None
            if any(t.nblocks is None for t in tables)
            else np.concatenate([t.nblocks for t in tables]),
        )

    def key(self, i: int) -> int:
        """The key chunk i's stored checksums are XORed with (0 where nothing binds them);
        computed for the chunks read, not for every chunk found."""
        if self.file_keys is None:
            return 0
        return chunk_key(int(self.file_keys[self.file[i]]), int(self.offset[i]))


def _concat_optional(columns: list[np.ndarray | None], lengths: list[int]) -> np.ndarray | None:
    """Optional columns of tables concatenated, zeros for the tables without (None if none has it)."""
    if all(c is None for c in columns):
        return None
    return np.concatenate(
        [np.zeros(n, np.int64) if c is None else c for c, n in zip(columns, lengths, strict=True)]
    )


class _LoadedFirst:
    """A field of LazyChunkTable that ChunkTable gives a class default: read before the
    table is fetched, it fetches it (the default would be read instead of __getattr__ being
    called). Once fetched, the instance's own value is found first."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        obj.fetch()
        return obj.__dict__[self.name]


class LazyChunkTable(ChunkTable):
    """The chunks of a v2 array, fetched from the record files on first use (tools such as
    verify and diff that walk every chunk; a restore fetches only what its boxes touch)."""

    crc_offset = _LoadedFirst()
    flags = _LoadedFirst()
    file_keys = _LoadedFirst()
    nblocks = _LoadedFirst()

    def __init__(self, load: Callable[[], ChunkTable]):  # no fields yet: see __getattr__
        self.__dict__["_load"] = load

    def fetch(self) -> None:
        """Fetch the table's records now (once)."""
        load = self.__dict__.pop("_load", None)
        if load is not None:
            self.__dict__.update(load().__dict__)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_load" not in self.__dict__:
            raise AttributeError(name)
        self.fetch()
        return getattr(self, name)


@dataclass
class ArrayLeaf:
    """An array leaf: a jax.Array, np.ndarray, NumPy scalar ('scalar') or typed PRNG key.

    v2: `layout` numbers the manifest's layout descriptions; `writers`, when present, are
    the only processes that wrote chunks of it (listed where the holders are many)."""

    path: Path
    kind: str
    dtype: str
    shape: tuple[int, ...]
    sharding: dict[str, Any] | None = None
    key_impl: str | None = None
    chunks: ChunkTable = field(default_factory=lambda: ChunkTable.empty(0))
    layout: int | None = None
    writers: tuple[int, ...] | None = None
    chunk_count: int | None = None  # v2: the number of chunks, known without the records

    @property
    def num_chunks(self) -> int:
        return self.chunk_count if self.chunk_count is not None else len(self.chunks)

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
    """A Python value stored in the manifest itself: int, float, bool, str, bytes or None."""

    path: Path
    value: Any

    @property
    def name(self) -> str:
        return path_str(self.path)


@dataclass
class PerProcessLeaf(ValueLeaf):
    """v2: a value each process saved for itself (snapshard.PerProcess), kept in that
    process's values file; `value` is filled in by a restore (None until then)."""


Leaf = ArrayLeaf | ValueLeaf


def values_file_name(process: int, nonce: str) -> str:
    return f"{INDEX_DIR}/p{process:05d}-{nonce}.values.json"


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
    if isinstance(v, bytes):
        return {"type": "bytes", "value": base64.b64encode(v).decode()}
    raise CorruptCheckpointError(f"{where}: cannot encode value {v!r}")


_MAX_INT_DIGITS = 4300  # Python's own limit for int('...')


def decode_value(d: Any, where: str) -> Any:
    try:
        t = d["type"]
        if t == "none":
            return None
        if t == "bool" and isinstance(d["value"], bool):
            return d["value"]
        if t == "int" and isinstance(d["value"], str) and len(d["value"]) <= _MAX_INT_DIGITS:
            return int(d["value"])
        if t == "float" and isinstance(d["value"], str):
            return float.fromhex(d["value"])
        if t == "str" and isinstance(d["value"], str):
            return d["value"]
        if t == "bytes" and isinstance(d["value"], str):
            return base64.b64decode(d["value"], validate=True)
    except (KeyError, TypeError, ValueError):
        pass
    raise CorruptCheckpointError(f"{where}: malformed value entry {str(d)[:200]}")


def _path_from_json(p: Any, where: str) -> Path:
    if not isinstance(p, list) or not all(
        isinstance(k, str | int) and not isinstance(k, bool) for k in p
    ):
        raise CorruptCheckpointError(f"{where}: malformed leaf path {str(p)[:200]}")
    return tuple(p)


def bounded_int(x: Any, lo: int, hi: int, what: str, where: str) -> int:
    """`x` if it is an int in [lo, hi], else a CorruptCheckpointError naming `what`."""
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise CorruptCheckpointError(f"{where}: malformed {what} {str(x)[:100]}")
    return x


def leaf_to_json(leaf: Leaf, chunks: bool = True) -> dict[str, Any]:
    if isinstance(leaf, PerProcessLeaf):
        return {"path": list(leaf.path), "kind": "per_process"}
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
    if leaf.layout is not None:
        out["layout"] = leaf.layout
    if leaf.writers is not None:
        out["writers"] = list(leaf.writers)
    if leaf.chunk_count is not None:
        out["chunk_count"] = leaf.chunk_count
    if chunks:
        out["chunks"] = leaf.chunks.rows()
    return out


def leaf_from_json(d: Any, where: str, version: int) -> Leaf:
    if not isinstance(d, dict):
        raise CorruptCheckpointError(f"{where}: malformed leaf entry")
    path = _path_from_json(d.get("path"), where)
    kind = d.get("kind")
    where = f"{where}, leaf {path_str(path)!r}"
    if kind == "value":
        return ValueLeaf(path, decode_value(d.get("value"), where))
    if kind == "per_process" and version >= 2:
        return PerProcessLeaf(path, None)
    if kind not in ARRAY_KINDS:
        raise CorruptCheckpointError(f"{where}: unknown leaf kind {str(kind)[:100]!r}")
    shape = d.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_DIM for s in shape
        )
        or math.prod(shape) > MAX_BYTES
    ):
        raise CorruptCheckpointError(f"{where}: malformed shape {str(shape)[:200]}")
    dtype = d.get("dtype")
    if not isinstance(dtype, str) or dtype not in NAME_TO_DTYPE:
        raise CorruptCheckpointError(f"{where}: unknown dtype {str(dtype)[:100]!r}")
    key_impl = d.get("key_impl")
    if key_impl is not None and not isinstance(key_impl, str):
        raise CorruptCheckpointError(f"{where}: malformed key_impl")
    sharding = d.get("sharding")
    leaf = ArrayLeaf(
        path=path,
        kind=kind,
        dtype=dtype,
        shape=tuple(shape),
        sharding=sharding if isinstance(sharding, dict) else None,
        key_impl=key_impl,
    )
    if version == 1:
        rows = d.get("chunks", [])
        if not isinstance(rows, list):
            raise CorruptCheckpointError(f"{where}: malformed chunk list")
        leaf.chunks = ChunkTable.from_rows(rows, len(shape), where)
        return leaf
    leaf.layout = bounded_int(d.get("layout"), 0, 1 << 31, "layout number", where)
    leaf.chunk_count = bounded_int(d.get("chunk_count"), 0, MAX_BYTES, "chunk count", where)
    writers = d.get("writers")
    if writers is not None:
        if not isinstance(writers, list) or len(writers) > MAX_PROCESSES:
            raise CorruptCheckpointError(f"{where}: malformed writer list")
        leaf.writers = tuple(bounded_int(w, 0, MAX_PROCESSES, "writer", where) for w in writers)
    return leaf


@dataclass
class FileEntry:
    """A data file of a manifest; `key` is its name key (format.binding) where its save
    binds its checksums to it (2.1), None where it does not (2.0, v1)."""

    name: str
    size: int
    key: int | None = None


@dataclass
class ProcessTable:
    """v2: what each process wrote: the nonce naming its files, the size of each data file,
    and the size and crc32c of its record file. Process q's data file j is global file
    `base[q] + j` of the manifest's flat file list."""

    nonces: list[str]
    data_sizes: list[list[int]]
    record_sizes: list[int]
    record_crcs: list[int]
    # sizes and crc32c of the per-process values files (empty lists: no such leaves)
    values_sizes: list[int] = field(default_factory=list)
    values_crcs: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.nonces)

    def record_name(self, q: int) -> str:
        return record_file_name(q, self.nonces[q])

    @property
    def base(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(s) for s in self.data_sizes])]).astype(np.int64)

    def files(self, bound: bool = True) -> list[FileEntry]:
        """The data files of every process, in global order (`bound`: with their keys)."""
        out = []
        for q, (n, sizes) in enumerate(zip(self.nonces, self.data_sizes, strict=True)):
            for j, size in enumerate(sizes):
                name = data_file_name(q, n, j)
                out.append(FileEntry(name, size, name_key(name) if bound else None))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "nonce": "".join(self.nonces),
            "data_sizes": self.data_sizes,
            "record_sizes": self.record_sizes,
            "record_crc32c": "".join(f"{c:08x}" for c in self.record_crcs),
            **(
                {"values_sizes": self.values_sizes,
                 "values_crc32c": "".join(f"{c:08x}" for c in self.values_crcs)}
                if self.values_sizes else {}
            ),
        }  # fmt: skip

    @staticmethod
    def from_json(d: Any, count: int, where: str) -> ProcessTable:
        if not isinstance(d, dict):
            raise CorruptCheckpointError(f"{where}: manifest lacks its process table")
        nonce, crcs = d.get("nonce"), d.get("record_crc32c")
        sizes, rsizes = d.get("data_sizes"), d.get("record_sizes")
        if not (
            isinstance(nonce, str) and isinstance(crcs, str) and isinstance(sizes, list)
            and isinstance(rsizes, list) and len(nonce) == len(crcs) == 8 * count
            and len(sizes) == len(rsizes) == count
        ):  # fmt: skip
            raise CorruptCheckpointError(
                f"{where}: the process table does not list {count} processes"
            )
        nonces = [nonce[8 * q : 8 * q + 8] for q in range(count)]
        if not all(_NONCE.fullmatch(n) for n in nonces):
            raise CorruptCheckpointError(f"{where}: malformed file nonce in the process table")
        try:
            record_crcs = [int(crcs[8 * q : 8 * q + 8], 16) for q in range(count)]
        except ValueError:
            raise CorruptCheckpointError(f"{where}: malformed record checksum") from None
        data_sizes = []
        for s in sizes:
            if not isinstance(s, list) or len(s) > MAX_FILES_PER_PROCESS:
                raise CorruptCheckpointError(f"{where}: malformed data file sizes")
            data_sizes.append([bounded_int(x, 0, MAX_BYTES, "file size", where) for x in s])
        record_sizes = [bounded_int(x, 0, MAX_BYTES, "record file size", where) for x in rsizes]
        table = ProcessTable(nonces, data_sizes, record_sizes, record_crcs)
        if "values_sizes" in d:
            vsizes, vcrcs = d.get("values_sizes"), d.get("values_crc32c")
            if not (isinstance(vsizes, list) and len(vsizes) == count and isinstance(vcrcs, str)
                    and len(vcrcs) == 8 * count):  # fmt: skip
                raise CorruptCheckpointError(f"{where}: malformed per-process value table")
            table.values_sizes = [bounded_int(x, 0, MAX_BYTES, "values file size", where) for x in vsizes]
            try:
                table.values_crcs = [int(vcrcs[8 * q : 8 * q + 8], 16) for q in range(count)]
            except ValueError:
                raise CorruptCheckpointError(f"{where}: malformed values checksum") from None
        return table


@dataclass
class Manifest:
    """The tree and its leaves; v1 lists every chunk inline, v2 the layouts and the process
    table through which a reader finds the chunk records it needs."""

    structure: JsonNode
    leaves: list[Leaf]
    files: list[FileEntry]
    process_count: int = 1
    write_mode: str = "auto"
    created_unix: float = field(default_factory=time.time)
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    meshes: list[dict[str, Any]] = field(default_factory=list)
    layouts: list[dict[str, Any]] = field(default_factory=list)
    processes: ProcessTable | None = None
    refs: list[Any] = field(default_factory=list)  # dicts, or None for an unused slot
    codecs: list[str] = field(default_factory=list)  # codecs some chunk uses (codecs.py)
    minor: int = FORMAT_MINOR  # of version 2: 0 for 2.0, 1 for 2.1 (format.binding)
    # v2: the format.finder.ChunkFinder that fetches chunk records (set by read_manifest)
    finder: Any = field(default=None, repr=False, compare=False)

    @property
    def bound(self) -> bool:
        """Whether the checksums of its files are bound to them (2.1, format.binding)."""
        return self.version == 2 and self.minor >= 1

    @property
    def version_text(self) -> str:
        return f"2.{self.minor}" if self.version == 2 and self.minor else str(self.version)

    @property
    def arrays(self) -> list[ArrayLeaf]:
        return [leaf for leaf in self.leaves if isinstance(leaf, ArrayLeaf)]

    @property
    def total_bytes(self) -> int:
        if self.version >= 2:
            return sum(a.nbytes for a in self.arrays)
        return sum(int(a.chunks.nbytes.sum()) for a in self.arrays)

    def leaf_by_path(self) -> dict[Path, Leaf]:
        return {leaf.path: leaf for leaf in self.leaves}

    def to_json(self) -> bytes:
        """The 2.1 manifest, with its own checksum (see docs/format.md)."""
        assert self.processes is not None, "a v2 manifest needs its process table"
        assert self.bound, "this library writes format 2.1 only"
        doc = {
            "format": FORMAT_NAME,
            "version": f"{FORMAT_VERSION}.{FORMAT_MINOR}",
            "checksum": "00000000",
            "created_unix": self.created_unix,
            "process_count": self.process_count,
            "write_mode": self.write_mode,
            "total_bytes": self.total_bytes,
            "tree": self.structure,
            "leaves": [leaf_to_json(leaf, chunks=False) for leaf in self.leaves],
            "meshes": self.meshes,
            "layouts": self.layouts,
            "processes": self.processes.to_json(),
            "refs": self.refs,
            **({"codecs": self.codecs} if self.codecs else {}),
            "extra": self.extra,
        }
        raw = json.dumps(doc, separators=(",", ":")).encode()
        at = raw.index(CHECKSUM_KEY) + len(CHECKSUM_KEY)
        return raw[:at] + f"{crc32c(raw):08x}".encode() + raw[at + 8 :]

    @staticmethod
    def from_json(data: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(data, object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            raise CorruptCheckpointError(
                f"{where}: manifest repeats the key {e.args[0][:100]!r}"
            ) from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        except RecursionError:
            raise CorruptCheckpointError(f"{where}: manifest is nested too deeply") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where}: not a snapshard manifest")
        version, minor = _version(doc.get("version"), where)
        if version >= 2:
            _check_own_checksum(data, doc, where)
        leaves_raw = doc.get("leaves")
        if not isinstance(leaves_raw, list):
            raise CorruptCheckpointError(f"{where}: manifest lacks its leaf list")
        structure = doc.get("tree")
        if not isinstance(structure, dict):
            raise CorruptCheckpointError(f"{where}: manifest lacks the tree structure")
        process_count = bounded_int(doc.get("process_count", 1), 1, MAX_PROCESSES, "process count", where)
        extra = doc.get("extra", {})
        if not isinstance(extra, dict):
            raise CorruptCheckpointError(f"{where}: malformed extra")
        created = doc.get("created_unix", 0.0)
        if isinstance(created, bool) or not isinstance(created, int | float) or not math.isfinite(created):
            raise CorruptCheckpointError(f"{where}: malformed created_unix {str(created)[:50]}")
        write_mode = doc.get("write_mode", "auto")
        if not isinstance(write_mode, str):
            raise CorruptCheckpointError(f"{where}: malformed write_mode {str(write_mode)[:50]}")
        m = Manifest(
            structure=structure,
            leaves=[leaf_from_json(d, where, version) for d in leaves_raw],
            files=[],
            process_count=process_count,
            write_mode=write_mode[:100],
            created_unix=float(created),
            version=version,
            extra=extra,
            minor=minor,
        )
        total = bounded_int(doc.get("total_bytes"), 0, MAX_BYTES, "total_bytes", where)
        if version == 1:
            files_raw = doc.get("files")
            if not isinstance(files_raw, list):
                raise CorruptCheckpointError(f"{where}: manifest lacks its file list")
            for f in files_raw:
                if not isinstance(f, dict):
                    raise CorruptCheckpointError(f"{where}: malformed file entry {str(f)[:200]}")
                name = check_file_name(f.get("name"), where)
                m.files.append(
                    FileEntry(name, bounded_int(f.get("size"), 0, MAX_BYTES, "file size", where))
                )
            _interned(m.leaves)
            _check_total(m, total, where)
            return m
        for key in ("meshes", "layouts", "refs"):
            value = doc.get(key, [])
            if not isinstance(value, list) or not all(
                isinstance(x, dict) or (x is None and key == "refs") for x in value
            ):
                raise CorruptCheckpointError(f"{where}: malformed {key} list")
            setattr(m, key, value)
        codecs = doc.get("codecs", [])
        if not isinstance(codecs, list) or not all(isinstance(c, str) for c in codecs):
            raise CorruptCheckpointError(f"{where}: malformed codecs list")
        m.codecs = codecs
        m.processes = ProcessTable.from_json(doc.get("processes"), process_count, where)
        m.files = m.processes.files(m.bound)
        if m.refs:  # referenced files follow the own ones (see format.refs)
            from .refs import ref_files

            m.files += ref_files(m.refs, where, m.bound)
        _check_total(m, total, where)
        return m


def _version(v: Any, where: str) -> tuple[int, int]:
    """(version, minor) of a manifest's `version`: the integers 1 and 2, or the string "2.1"
    (no other type: 2.0 and true are not versions)."""
    if type(v) is int and v in READ_VERSIONS:
        return v, 0
    if type(v) is str and v in READ_VERSIONS:
        major, minor = v.split(".")
        return int(major), int(minor)
    raise CorruptCheckpointError(
        f"{where}: manifest format version {str(v)[:20]} is not supported "
        f"(this library reads {', '.join(map(str, READ_VERSIONS))})"
    )


def _check_total(m: Manifest, stated: int, where: str) -> None:
    if stated != m.total_bytes:
        raise CorruptCheckpointError(
            f"{where}: manifest says total_bytes {stated}, its arrays hold {m.total_bytes}"
        )


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing repeated keys (json.loads would keep the last silently)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))  # type: ignore[func-returns-value]
    return d


def _check_own_checksum(data: bytes, doc: dict[str, Any], where: str) -> None:
    at = data.find(CHECKSUM_KEY)
    stated = doc.get("checksum")
    if at < 0 or not isinstance(stated, str) or len(stated) != 8:
        raise CorruptCheckpointError(f"{where}: manifest lacks its checksum")
    at += len(CHECKSUM_KEY)
    actual = crc32c(data[:at] + b"00000000" + data[at + 8 :])
    if data[at : at + 8] != stated.encode() or f"{actual:08x}" != stated:
        raise CorruptCheckpointError(
            f"{where}: manifest checksum mismatch (stated {stated!r}, computed {actual:08x})"
        )


def _interned(leaves: list[Leaf]) -> list[Leaf]:
    seen: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
    for leaf in leaves:
        if isinstance(leaf, ArrayLeaf) and len(leaf.chunks):
            leaf.chunks.intern_boxes(seen)
    return leaves
