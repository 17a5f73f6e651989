"""Where safetensors files are: a file, a directory, or an index JSON; local or object store.

Reads go through the checkpoint storage's `read_into(name, offset, buffers)`, so every
backend that can read a checkpoint can read safetensors files. What a Storage does not offer
for plain files (sizes, directory listings) is taken from the local filesystem where there
is one; on object stores a directory needs its index (or a single model.safetensors).
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..storage import LocalStorage, Location, Storage, parse_location, storage_for
from .header import LENGTH_BYTES, Header, header_length, parse_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
MAX_INDEX_BYTES = 256 << 20


@dataclass
class FileSet:
    """The storage of a directory and the headers of the safetensors files read from it."""

    storage: Storage
    names: list[str]  # file names relative to the storage
    headers: list[Header]
    owns_storage: bool

    def close(self) -> None:
        if self.owns_storage:
            self.storage.close()


def _split(location: str) -> tuple[str, str | None]:
    """(directory, file name or None) of a location naming a directory, a file or an index."""
    loc = parse_location(location)
    named = loc.path.endswith((SUFFIX, ".json"))
    if not named and loc.local_path is not None and os.path.isfile(loc.local_path):
        named = True  # a local file of any name (`model.bin`): recognised by its header
    if location.endswith("/") or not named:
        return location, None
    if loc.scheme:
        return loc.parent_and_name()
    return os.path.dirname(os.path.abspath(location)) or ".", os.path.basename(location)


def _safe_name(name: Any, where: str) -> str:
    """A file name from an index, refusing anything that could leave the directory."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith("/")
        or "\\" in name
        or ".." in name.split("/")
        or posixpath.normpath(name) != name
    ):
        raise CorruptCheckpointError(f"{where}: unsafe or malformed file name {name!r}")
    return name


class Reader:
    """Small whole-range reads of plain files through a Storage."""

    def __init__(self, storage: Storage, local_dir: str | None):
        self.storage = storage
        self.local_dir = local_dir

    def size(self, name: str) -> int | None:
        if self.local_dir is None:
            return None
        try:
            return os.path.getsize(os.path.join(self.local_dir, name))
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no safetensors file {name!r} in {self.local_dir}"
            ) from None

    def read(self, name: str, offset: int, n: int, what: str) -> bytes:
        """Exactly n bytes at offset, or a CorruptCheckpointError saying the file is short."""
        buf = np.empty(n, dtype=np.uint8)
        try:
            self.storage.read_into(name, offset, [buf.data])
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no file {name!r} at {self.storage.url}") from None
        except (CorruptCheckpointError, OSError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{self.storage.url}/{name} is truncated or unreadable: cannot read {what} "
                f"(bytes {offset}..{offset + n}): {e}"
            ) from None
        return buf.tobytes()

    def header(self, name: str) -> Header:
        where = f"{self.storage.url}/{name}"
        size = self.size(name)
        if size is not None and size < LENGTH_BYTES:
            raise CorruptCheckpointError(
                f"safetensors file {where!r} is truncated: {size} bytes, fewer than the 8-byte header length"
            )
        n = header_length(self.read(name, 0, LENGTH_BYTES, "the header length"), where)
        if size is not None and LENGTH_BYTES + n > size:
            raise CorruptCheckpointError(
                f"safetensors file {where!r} is truncated: the header claims {n} bytes, "
                f"the file has {size - LENGTH_BYTES} after the length"
            )
        header = parse_header(self.read(name, LENGTH_BYTES, n, "the header"), where, size)
        if size is None and header.data_end > header.data_start:
            # No size to compare with: the last byte must at least be readable.
            self.read(name, header.data_end - 1, 1, "the last tensor byte")
        return header


def _index(raw: bytes, where: str) -> tuple[list[str], dict[str, str]]:
    """The data files an index JSON names (in order of first appearance), and its weight map."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: index is not valid JSON ({e})") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) for k in wm):
        raise CorruptCheckpointError(f"{where}: index has no weight_map of tensor names to files")
    files = list(dict.fromkeys(_safe_name(v, where) for v in wm.values()))
    return files, wm


def open_files(location: Location | Storage) -> tuple[FileSet, dict[str, str] | None]:
    """Read and validate the headers of every safetensors file a location names.

    Returns the file set and, for an index, its weight map (tensor -> file) to check against.
    """
    if isinstance(location, Storage):
        local = str(location.final) if isinstance(location, LocalStorage) else None
        storage, name, owns = location, None, False
    else:
        directory, name = _split(os.fspath(location))
        local = parse_location(directory).local_path
        if local is not None and not os.path.isdir(local):
            raise CheckpointNotFoundError(
                f"no safetensors file or directory at {os.fspath(location)}"
            )
        storage, owns = storage_for(directory), True
    reader = Reader(storage, local)
    try:
        weight_map = None
        if name is None:
            name = _default_name(reader)
        if name.endswith(".json"):
            where = f"{storage.url}/{name}"
            size = reader.size(name)
            if size is None:
                raw = _read_unsized(reader, name)
            else:
                if size > MAX_INDEX_BYTES:
                    raise CorruptCheckpointError(f"{where}: index of {size} bytes is too large")
                raw = reader.read(name, 0, size, "the index")
            files, weight_map = _index(raw, where)
        elif name == "*":
            files = sorted(f for f in os.listdir(local or ".") if f.endswith(SUFFIX))
        else:
            files = [name]
        headers = [reader.header(f) for f in files]
    except BaseException:
        if owns:
            storage.close()
        raise
    return FileSet(storage, files, headers, owns), weight_map


def _default_name(reader: Reader) -> str:
    """In a directory: the index if there is one, else every .safetensors file (local) or
    model.safetensors (object stores, which cannot be listed through a Storage)."""
    if reader.local_dir is None:
        try:
            reader.read(INDEX_NAME, 0, 1, "the index")
            return INDEX_NAME
        except (CorruptCheckpointError, CheckpointNotFoundError, OSError):
            return SINGLE_NAME
    if os.path.isfile(os.path.join(reader.local_dir, INDEX_NAME)):
        return INDEX_NAME
    if not any(f.endswith(SUFFIX) for f in os.listdir(reader.local_dir)):
        raise CheckpointNotFoundError(f"no .safetensors files in {reader.local_dir}")
    return "*"


def _read_unsized(reader: Reader, name: str) -> bytes:
    """A small file of unknown size (an index on an object store), read in growing pieces."""
    out = bytearray()
    piece = 1 << 16
    while len(out) < MAX_INDEX_BYTES:
        try:
            out += reader.read(name, len(out), piece, "the index")
        except CorruptCheckpointError:
            # The last piece is short: find its length by halving (few reads for small files).
            step = piece // 2
            while step:
                try:
                    out += reader.read(name, len(out), step, "the index")
                except CorruptCheckpointError:
                    step //= 2
            return bytes(out)
        piece *= 2
    raise CorruptCheckpointError(f"{reader.storage.url}/{name}: index is too large")
