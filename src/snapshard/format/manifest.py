"""The manifest: the one file every reader parses. See docs/format.md.

Format v2: the tree, per leaf its path, dtype, shape and layout, per distinct
layout a compact description (format.layouts), and per process its data files, its record
file and that file's checksum; nothing per chunk. Chunk records live in the per-process
record files (format.records) and checksums beside the data they cover. 2.1 (written)
binds every stored checksum to its file (format.binding); 2.0 (read) did not.

Format v1 (read): the same tree, with every chunk of every array inline as JSON, and
per-process JSON indexes that the committer merged.

This module holds the Manifest and its JSON document; the parts it is made of live beside
it, one concern each: format.naming (names and versions), format.bounds, format.kinds,
format.chunks (chunk tables), format.values, format.leaves and format.files (the file list
and the process table). Their names are re-exported here for the modules that import them
from the manifest.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checksum import crc32c
from ..errors import CorruptCheckpointError
from ..tree import JsonNode, Path
from . import json_pieces
from .bounds import MAX_BYTES, MAX_PROCESSES, bounded_int
from .files import FileEntry, ProcessTable
from .leaves import ArrayLeaf, Leaf, interned, leaf_from_json, leaf_to_json
from .naming import (
    CHECKSUM_KEY,
    FORMAT_MINOR,
    FORMAT_NAME,
    FORMAT_VERSION,
    LEAF_MAP_MINOR,
    READ_VERSIONS,
    check_file_name,
)
from .refs import ref_files


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

    @classmethod
    def of_processes(
        cls,
        processes: ProcessTable,
        structure: JsonNode,
        leaves: list[Leaf],
        *,
        write_mode: str,
        layouts: list[dict[str, Any]],
        meshes: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
        codecs: list[str] | None = None,
    ) -> Manifest:
        """The manifest every writer of this library commits (format 2.1, or 2.2 where the
        table has a leaf map): `leaves` over the data files of `processes`, in the table's
        order, one process each row."""
        return cls(
            structure=structure, leaves=leaves, files=processes.files(),
            process_count=len(processes.nonces), write_mode=write_mode, extra=extra or {},
            meshes=meshes or [], layouts=layouts, processes=processes, codecs=codecs or [],
        )  # fmt: skip

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

    def local_leaves(self, q: int, leaves: np.ndarray) -> np.ndarray:
        """The numbers in process q's record and values files of leaves `leaves` (manifest
        indices; -1 where q saved none of a leaf: format.leaf_map)."""
        assert self.processes is not None
        return self.processes.local_leaves(q, leaves, len(self.leaves))

    def to_json(self) -> bytes:
        """The 2.1 manifest (2.2 with a leaf map), with its own checksum (docs/format.md)."""
        assert self.processes is not None, "a v2 manifest needs its process table"
        assert self.bound, "this library writes format 2.1 and 2.2 only"
        minor = FORMAT_MINOR if self.processes.leaf_map is None else LEAF_MAP_MINOR
        doc = {
            "format": FORMAT_NAME,
            "version": f"{FORMAT_VERSION}.{minor}",
            "checksum": "00000000",
            "created_unix": self.created_unix,
            "process_count": self.process_count,
            "write_mode": self.write_mode,
            "total_bytes": self.total_bytes,
            "tree": self.structure,
            "leaves": [leaf_to_json(leaf) for leaf in self.leaves],
            "meshes": self.meshes,
            "layouts": self.layouts,
            "processes": self.processes.to_json(),
            "refs": self.refs,
            **({"codecs": self.codecs} if self.codecs else {}),
            "extra": self.extra,
        }
        raw = json_pieces.dumps(doc).encode()
        at = raw.index(CHECKSUM_KEY) + len(CHECKSUM_KEY)
        return raw[:at] + f"{crc32c(raw):08x}".encode() + raw[at + 8 :]

    @staticmethod
    def from_json(data: bytes, where: str) -> Manifest:
        doc, version, minor = _checked_document(data, where)
        m = _header(doc, where, version, minor)
        total = _total_bytes(doc, where)
        if version == 1:
            m.files = _v1_files(doc, where)
            interned(m.leaves)
        else:
            _v2_tables(m, doc, where)
        if total != m.total_bytes:
            raise CorruptCheckpointError(
                f"{where}: manifest says total_bytes {total}, its arrays hold {m.total_bytes}"
            )
        return m


def _parse_document(data: bytes, where: str) -> dict[str, Any]:
    """The manifest's JSON object, refusing repeated keys, bad JSON and other formats."""
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
    return doc


def _checked_document(data: bytes, where: str) -> tuple[dict[str, Any], int, int]:
    """(the manifest's JSON object, version, minor), v2 checked against its own checksum:
    what every reader of a manifest, whole or summary, trusts first."""
    doc = _parse_document(data, where)
    version, minor = _version(doc.get("version"), where)
    if version >= 2:
        _check_own_checksum(data, doc, where)
    return doc, version, minor


def _total_bytes(doc: dict[str, Any], where: str) -> int:
    return bounded_int(doc.get("total_bytes"), 0, MAX_BYTES, "total_bytes", where)


@dataclass(frozen=True)
class ManifestSummary:
    """A manifest's own fields, for listings (the CLI's `ls`, a manager's scan of its
    steps): checked against the manifest's checksum, its tree and leaves not parsed."""

    version: int
    minor: int
    created_unix: float
    total_bytes: int
    leaf_count: int
    extra: dict[str, Any]

    @staticmethod
    def from_json(data: bytes, where: str) -> ManifestSummary:
        doc, version, minor = _checked_document(data, where)
        return ManifestSummary(
            version, minor, _created(doc, where), _total_bytes(doc, where),
            len(_leaf_list(doc, where)), _extra(doc, where),
        )  # fmt: skip


def _leaf_list(doc: dict[str, Any], where: str) -> list[Any]:
    leaves = doc.get("leaves")
    if not isinstance(leaves, list):
        raise CorruptCheckpointError(f"{where}: manifest lacks its leaf list")
    return leaves


def _extra(doc: dict[str, Any], where: str) -> dict[str, Any]:
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise CorruptCheckpointError(f"{where}: malformed extra")
    return extra


def _created(doc: dict[str, Any], where: str) -> float:
    created = doc.get("created_unix", 0.0)
    if (
        isinstance(created, bool)
        or not isinstance(created, int | float)
        or not math.isfinite(created)
    ):
        raise CorruptCheckpointError(f"{where}: malformed created_unix {str(created)[:50]}")
    return float(created)


def _header(doc: dict[str, Any], where: str, version: int, minor: int) -> Manifest:
    """The manifest with its tree, leaves and scalar fields (files and tables still empty)."""
    leaves_raw = _leaf_list(doc, where)
    structure = doc.get("tree")
    if not isinstance(structure, dict):
        raise CorruptCheckpointError(f"{where}: manifest lacks the tree structure")
    process_count = bounded_int(
        doc.get("process_count", 1), 1, MAX_PROCESSES, "process count", where
    )
    extra = _extra(doc, where)
    created = _created(doc, where)
    write_mode = doc.get("write_mode", "auto")
    if not isinstance(write_mode, str):
        raise CorruptCheckpointError(f"{where}: malformed write_mode {str(write_mode)[:50]}")
    shardings: dict[str, Any] = {}  # equal descriptions, one object (leaf_from_json)
    return Manifest(
        structure=structure,
        leaves=[leaf_from_json(d, where, version, shardings) for d in leaves_raw],
        files=[],
        process_count=process_count,
        write_mode=write_mode[:100],
        created_unix=created,
        version=version,
        extra=extra,
        minor=minor,
    )


def _v1_files(doc: dict[str, Any], where: str) -> list[FileEntry]:
    """v1: the manifest's own file list."""
    files_raw = doc.get("files")
    if not isinstance(files_raw, list):
        raise CorruptCheckpointError(f"{where}: manifest lacks its file list")
    out = []
    for f in files_raw:
        if not isinstance(f, dict):
            raise CorruptCheckpointError(f"{where}: malformed file entry {str(f)[:200]}")
        name = check_file_name(f.get("name"), where)
        out.append(FileEntry(name, bounded_int(f.get("size"), 0, MAX_BYTES, "file size", where)))
    return out


def _v2_tables(m: Manifest, doc: dict[str, Any], where: str) -> None:
    """v2: the meshes, layouts, references, codecs and process table, and the file list
    they imply (the own files, then the referenced ones: format.refs)."""
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
    m.processes = ProcessTable.from_json(
        doc.get("processes"), m.process_count, where,
        len(m.leaves) if m.minor >= LEAF_MAP_MINOR else None,
    )  # fmt: skip
    m.files = m.processes.files(m.bound)
    if m.refs:
        m.files += ref_files(m.refs, where, m.bound)


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
