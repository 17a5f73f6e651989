"""Write a snapshard checkpoint from one process, one box at a time (for converters).

Memory holds one box at a time. Boxes are appended to data files (a new file every
`file_bytes`), each box one chunk with its checksums. `commit` builds the manifest,
validates it (every array tiled exactly once) and commits it through the storage's
protocol, so the checkpoint appears whole or not at all, as with `snapshard.save`.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from ..checksum import crc32c
from ..dtypes import dtype_from_name, little_endian
from ..errors import SnapshardError
from ..format import (
    ArrayLeaf,
    ChunkTable,
    FileEntry,
    Leaf,
    Manifest,
    ProcessTable,
    ValueLeaf,
    data_file_name,
    record_file_name,
    records,
    validate_coverage,
)
from ..format.binding import name_key
from ..format.encoding import chunk_span, write_chunk
from ..format.records import records_of
from ..storage import FileWriter, Location, Storage, storage_for
from ..tree import JsonNode, Path
from . import commit_manifest, refuse_existing, staged_files

FILE_BYTES = 1 << 30  # a new data file is started past this


class CheckpointWriter:
    """Leaves are added in the order of the tree structure given to `commit`."""

    def __init__(
        self,
        location: Location | Storage,
        *,
        overwrite: bool = False,
        extra: dict[str, Any] | None = None,
    ):
        self.storage = storage_for(location)
        self.url = self.storage.url
        refuse_existing(self.storage, overwrite)
        self.overwrite, self.extra = overwrite, extra or {}
        self.nonce = uuid.uuid4().hex[:8]
        self.leaves: list[Leaf] = []
        self._rows: dict[int, list[tuple[Any, ...]]] = {}
        self.files: list[FileEntry] = []
        self._file: FileWriter | None = None
        self._offset = 0
        self.storage.prepare_staging()

    def add_value(self, path: Path, value: Any) -> None:
        self.leaves.append(ValueLeaf(path, value))

    def add_array(
        self,
        path: Path,
        *,
        kind: str,
        dtype: str,
        shape: tuple[int, ...],
        sharding: dict[str, Any] | None,
        key_impl: str | None = None,
    ) -> int:
        """Declare an array leaf; returns its number for `write_box`."""
        self.leaves.append(ArrayLeaf(path, kind, dtype, tuple(shape), sharding, key_impl))
        self._rows[len(self.leaves) - 1] = []
        return len(self.leaves) - 1

    def write_box(self, leaf: int, start: Any, stop: Any, data: np.ndarray) -> None:
        """Box [start, stop) of array `leaf`, in its declared dtype, as one chunk."""
        a = self.leaves[leaf]
        assert isinstance(a, ArrayLeaf)
        arr = little_endian(np.asarray(data, order="C"))
        want = tuple(int(e) - int(s) for s, e in zip(start, stop, strict=True))
        if arr.dtype != dtype_from_name(a.dtype) or arr.shape != want:
            raise SnapshardError(
                f"{self.url}: box of leaf {a.name!r} is {arr.dtype}{list(arr.shape)}, "
                f"expected {a.dtype}{list(want)}"
            )
        if self._file is None or self._offset >= FILE_BYTES:
            self._next_file()
        assert self._file is not None
        row = write_chunk(
            self._file, arr, start, stop, len(self.files), self._offset,
            file_key=name_key(self._file_name()),
        )  # fmt: skip
        self._rows[leaf].append(row)
        self._offset += chunk_span(arr.nbytes)

    def _file_name(self) -> str:
        return data_file_name(0, self.nonce, len(self.files))

    def _next_file(self) -> None:
        self._close_file()
        self._file = self.storage.open_writer(self._file_name())
        self._offset = 0

    def _close_file(self) -> None:
        if self._file is not None:
            self.files.append(FileEntry(self._file_name(), self._file.close()))
            self._file = None

    def commit(self, structure: JsonNode) -> Manifest:
        """Validate and commit; the checkpoint is visible from here on."""
        try:
            self._close_file()
            ndims = [len(x.shape) if isinstance(x, ArrayLeaf) else 0 for x in self.leaves]
            segments = {i: records_of(rows, ndims[i]) for i, rows in self._rows.items() if rows}
            record_name = record_file_name(0, self.nonce)
            digests = np.zeros(len(self.leaves), records.DIGEST)
            data = records.encode(0, ndims, segments, digests, salt=name_key(record_name))
            self.storage.write_bytes(record_name, data)
            for i, leaf in enumerate(self.leaves):
                if isinstance(leaf, ArrayLeaf):
                    leaf.layout = 0
                    r = segments.get(i)
                    leaf.chunk_count = 0 if r is None else len(r)
                    leaf.chunks = ChunkTable.empty(ndims[i]) if r is None else ChunkTable(
                        r["start"].reshape(len(r), ndims[i]), r["stop"].reshape(len(r), ndims[i]),
                        r["file"].astype(np.int64), r["offset"].astype(np.int64),
                        r["nbytes"].astype(np.int64), r["block"].astype(np.int64), [],
                        r["crc_offset"].astype(np.int64),
                    )  # fmt: skip
            table = ProcessTable(
                [self.nonce], [[f.size for f in self.files]], [len(data)], [crc32c(data)]
            )
            manifest = Manifest.of_processes(
                table, structure, self.leaves, write_mode="single_replica", extra=self.extra,
                layouts=[{"kind": "host"}],  # every leaf's: layout 0
            )  # fmt: skip
            validate_coverage(manifest, self.url)  # (the boxes came from the caller)
            # Files an earlier, interrupted attempt left in the staging area do not commit.
            commit_manifest(self.storage, manifest, staged_files(table), overwrite=self.overwrite)
        except BaseException:
            self.abort()
            raise
        return manifest

    def abort(self) -> None:
        """Give up: nothing becomes visible, what was staged is removed."""
        if self._file is not None:
            self._file.abort()
            self._file = None
        self.storage.discard_staging()

    def close(self) -> None:
        self.storage.close()
