"""Safetensors files as a CheckpointSource (reading/sources.py): what the read executor and
read-once planning read them through. Each tensor's bytes are one chunk of its file (the
Planner's chunk tables); reads are never verified: the files carry no checksums."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from ..format import ArrayLeaf, FileEntry
from ..options import ReadOptions
from ..reading import Dest, ReadStats, chunk_boxes, table_reader
from .files import FileSet


@dataclass
class SafetensorsSource:
    """The tensors of a set of safetensors files, read by byte ranges through the files'
    storage. There is no saved tree: a load names the tensors it wants (safetensors.loader)."""

    files: FileSet
    options: ReadOptions
    format: str = "safetensors"
    entries: list[FileEntry] = field(init=False)  # the files, numbered as the chunk tables do

    def __post_init__(self) -> None:
        self.entries = [
            FileEntry(n, h.data_end)
            for n, h in zip(self.files.names, self.files.headers, strict=True)
        ]
        self.options = replace(self.options, verify=False)

    @property
    def url(self) -> str:
        return self.files.storage.url

    def read_dests(self, dests: list[Dest], stats: ReadStats) -> None:
        table_reader(self.files.storage, self.entries, self.options, stats)(dests)

    def saved_boxes(self, leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
        return chunk_boxes(leaf)
