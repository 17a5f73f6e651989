"""The data files of a manifest and, in v2, the process table that names them, made at commit
from each process's report (`ProcessReport`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .binding import name_key
from .bounds import MAX_BYTES, MAX_FILES_PER_PROCESS, bounded_int
from .leaf_map import LeafMap
from .naming import NONCE, data_file_name, record_file_name


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
    # which leaves each process saved, where the trees differ by process (format 2.2)
    leaf_map: LeafMap | None = None

    def __len__(self) -> int:
        return len(self.nonces)

    def record_name(self, q: int) -> str:
        return record_file_name(q, self.nonces[q])

    def leaf_count(self, q: int, manifest_leaves: int) -> int:
        """How many leaves process q's record and values files number."""
        return manifest_leaves if self.leaf_map is None else self.leaf_map.count(q)

    def local_leaves(self, q: int, leaves: np.ndarray, manifest_leaves: int) -> np.ndarray:
        """The numbers in process q's files of manifest leaves `leaves` (-1: q saved none)."""
        if self.leaf_map is None:
            return np.asarray(leaves, np.int64)
        return self.leaf_map.local(q, leaves, manifest_leaves)

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
            **(self.leaf_map.to_json() if self.leaf_map is not None else {}),
        }  # fmt: skip

    @staticmethod
    def from_json(d: Any, count: int, where: str, leaf_count: int | None = None) -> ProcessTable:
        """The table of a manifest of `count` processes; `leaf_count`: its leaves, where
        its version may map them (2.2)."""
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
        if not all(NONCE.fullmatch(n) for n in nonces):
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
            table.values_sizes = [
                bounded_int(x, 0, MAX_BYTES, "values file size", where) for x in vsizes
            ]
            try:
                table.values_crcs = [int(vcrcs[8 * q : 8 * q + 8], 16) for q in range(count)]
            except ValueError:
                raise CorruptCheckpointError(f"{where}: malformed values checksum") from None
        if "trees" in d or "tree_of" in d:
            if leaf_count is None:
                raise CorruptCheckpointError(
                    f"{where}: the process table maps leaves, which only format 2.2 does"
                )
            table.leaf_map = LeafMap.from_json(d, count, leaf_count, where)
        return table


@dataclass(frozen=True)
class ProcessReport:
    """What one process of a save tells process 0 once it has written (the coordinator
    carries it as JSON, `to_json`): its attempt's nonce, the sizes of its data files, the
    size and crc32c of its record and values files, the digest of the tree as it saw it,
    what an incremental save referenced, and what compression saved."""

    nonce: str
    sizes: tuple[int, ...]
    record_size: int
    record_crc: int
    values_size: int
    values_crc: int
    digest: int
    refs_used: tuple[int, ...] = ()  # indexes into the base's reference candidates
    referenced_bytes: int = 0  # chunk bytes recorded as references, not written
    ref_codecs: tuple[int, ...] = ()  # codecs of the referenced chunks
    packed_saved: int = 0  # bytes compression saved
    codecs: tuple[int, ...] = ()  # codecs of the chunks written
    # SaveOptions.trees_differ: the digest naming its tree file (format.naming.tree_file_name)
    # and the bytes its own plan gives it; "" and 0 otherwise
    tree: str = ""
    planned_bytes: int = 0
    location: int = 0  # crc32c of the URL it saved to (a manager's step: every process's one)
    copies: int = 0  # the fingerprints of the copies it holds (saving/copies.py), summed up

    def to_json(self) -> dict[str, Any]:
        """The report as the coordinator carries it."""
        return {
            **({"tree": self.tree, "planned_bytes": self.planned_bytes} if self.tree else {}),
            "nonce": self.nonce, "sizes": list(self.sizes), "record_size": self.record_size,
            "record_crc": self.record_crc, "values_size": self.values_size,
            "values_crc": self.values_crc, "digest": self.digest,
            "refs_used": list(self.refs_used), "referenced_bytes": self.referenced_bytes,
            "ref_codecs": list(self.ref_codecs), "packed_saved": self.packed_saved,
            "codecs": list(self.codecs), "location": self.location, "copies": self.copies,
        }  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ProcessReport:
        ints = lambda key: tuple(int(x) for x in doc.get(key, ()))  # noqa: E731
        return cls(
            str(doc["nonce"]), ints("sizes"), int(doc["record_size"]), int(doc["record_crc"]),
            int(doc.get("values_size", 0)), int(doc.get("values_crc", 0)), int(doc["digest"]),
            ints("refs_used"), int(doc.get("referenced_bytes", 0)), ints("ref_codecs"),
            int(doc.get("packed_saved", 0)), ints("codecs"), str(doc.get("tree", "")),
            int(doc.get("planned_bytes", 0)), int(doc.get("location", 0)),
            int(doc.get("copies", 0)),
        )  # fmt: skip
