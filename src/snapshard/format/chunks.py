"""Chunk tables: the chunks of one array, column by column, as a reader holds them (v1
parses them from the manifest, v2 fetches them from the record files: format.finder)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .binding import chunk_key

MIN_CHECKSUM_BLOCK = 4 << 10
MAX_BLOCKS_PER_CHUNK = 256


def checksum_block(nbytes: int) -> int:
    """Bytes per checksum block of a chunk: at least 4 KiB, at most 256 blocks per chunk.

    Small blocks let a partial read verify what it reads without reading much more; the cap
    keeps the manifest small for large chunks.
    """
    if nbytes <= MIN_CHECKSUM_BLOCK:
        return max(nbytes, 1)
    per = -(-nbytes // MAX_BLOCKS_PER_CHUNK)
    return max(MIN_CHECKSUM_BLOCK, -(-per // 4096) * 4096)


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
    # The table whose rows these are, and where they start in it (`between`): a reader of
    # many small tables gathers their columns from it at once (reading.plan).
    rows_of: tuple[ChunkTable, int] | None = None

    @staticmethod
    def empty(ndim: int) -> ChunkTable:
        z = np.zeros(0, dtype=np.int64)
        return ChunkTable(
            np.zeros((0, ndim), np.int64), np.zeros((0, ndim), np.int64), z, z, z, z, [], z
        )

    def take(self, o: np.ndarray) -> ChunkTable:
        """The chunks at positions `o`, in that order."""
        return ChunkTable(
            self.starts[o], self.stops[o], self.file[o], self.offset[o], self.nbytes[o], self.block[o],
            [self.crc32c[i] for i in o.tolist()] if self.crc32c else [],
            None if self.crc_offset is None else self.crc_offset[o],
            None if self.flags is None else self.flags[o],
            self.file_keys,
            None if self.nblocks is None else self.nblocks[o],
        )  # fmt: skip

    def between(
        self, lo: int, hi: int, boxes: tuple[np.ndarray, np.ndarray] | None = None
    ) -> ChunkTable:
        """Chunks lo:hi (a table of many arrays' chunks cut into the arrays' own:
        format.finder), their columns sliced from this table's when first read (RowsTable);
        `boxes`: their box columns, where the caller has them already (equal to these
        rows', shared with other tables)."""
        source, at = self.rows_of or (self, 0)
        starts, stops = boxes or (self.starts[lo:hi], self.stops[lo:hi])
        return RowsTable(source, at + lo, at + hi, starts, stops)

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

    def intern_boxes(self, seen: dict[bytes, tuple[np.ndarray, np.ndarray]]) -> None:
        """Share the box columns with an earlier table of equal boxes (one index serves both)."""
        self.starts, self.stops = shared_boxes(seen, self.starts, self.stops)

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
            concat_optional([t.flags for t in tables], [len(t) for t in tables]),
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


def shared_boxes(
    seen: dict[bytes, tuple[np.ndarray, np.ndarray]], starts: np.ndarray, stops: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Box columns `starts`, `stops`, or an equal pair met before (kept in `seen`)."""
    return seen.setdefault(starts.tobytes() + b"|" + stops.tobytes(), (starts, stops))


def concat_optional(columns: list[np.ndarray | None], lengths: list[int]) -> np.ndarray | None:
    """Optional columns of tables concatenated, zeros for the tables without (None if none has it)."""
    if all(c is None for c in columns):
        return None
    return np.concatenate(
        [np.zeros(n, np.int64) if c is None else c for c, n in zip(columns, lengths, strict=True)]
    )


class _Deferred:
    """A field that ChunkTable gives a class default, of a table that makes its fields when
    first read (LazyChunkTable: fetched; RowsTable: sliced from its source's): the default
    would be read instead of __getattr__ being called. Once made, the instance's own value
    is found first."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else obj.column(self.name)


class LazyChunkTable(ChunkTable):
    """The chunks of a v2 array, fetched from the record files on first use (tools such as
    verify and diff that walk every chunk; a restore fetches only what its boxes touch)."""

    crc_offset = _Deferred()
    flags = _Deferred()
    file_keys = _Deferred()
    nblocks = _Deferred()
    rows_of = _Deferred()

    def __init__(self, load: Callable[[], ChunkTable]):  # no fields yet: see __getattr__
        self.__dict__["_load"] = load

    def fetch(self) -> None:
        """Fetch the table's records now (once)."""
        load = self.__dict__.pop("_load", None)
        if load is not None:
            t = load()
            self.__dict__.update({f.name: getattr(t, f.name) for f in fields(ChunkTable)})

    def column(self, name: str) -> Any:
        self.fetch()
        return self.__dict__[name]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "_load" not in self.__dict__:
            raise AttributeError(name)
        self.fetch()
        return getattr(self, name)


class RowsTable(ChunkTable):
    """Chunks lo:hi of a source table (`between`), their columns sliced from the source's
    when first read. A restore of many small arrays reads most of its chunks through the
    source's columns at once (reading.plan, by `rows_of`): most of these views would be
    made and freed unread, several per array."""

    crc_offset = _Deferred()
    flags = _Deferred()
    nblocks = _Deferred()

    def __init__(
        self, source: ChunkTable, lo: int, hi: int, starts: np.ndarray, stops: np.ndarray
    ):  # the other fields: see column
        d = self.__dict__
        d["starts"], d["stops"], d["rows_of"], d["_stop"] = starts, stops, (source, lo), hi
        d["file_keys"] = source.file_keys

    def column(self, name: str) -> Any:
        """A column of these rows, sliced from the source's (once)."""
        source, lo = self.__dict__["rows_of"]
        col = getattr(source, name)
        if col is not None:
            col = col[lo : self.__dict__["_stop"]]
            if name == "flags" and not col.any():
                col = None  # (None: nothing compressed, as readers test first)
        self.__dict__[name] = col
        return col

    def __getattr__(self, name: str) -> Any:  # the fields without a class default
        if name in _ROW_COLUMNS:
            return self.column(name)
        raise AttributeError(name)

    def __len__(self) -> int:
        return int(self.__dict__["_stop"]) - int(self.__dict__["rows_of"][1])


_ROW_COLUMNS = frozenset({"file", "offset", "nbytes", "block", "crc32c"})
