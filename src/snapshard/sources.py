"""Where a restore's bytes come from: one interface for snapshard and Orbax checkpoints, so
that the restore never imports the readers of other formats, nor they it.

A `CheckpointSource` is a manifest (the tree and its leaves, as snapshard's format
describes them) and `read_dests`, which fills the read executor's host buffers. snapshard
checkpoints are read by the executor itself; Orbax checkpoints through TensorStore
(interop.orbax); safetensors files by byte ranges (snapshard.safetensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .errors import CheckpointNotFoundError
from .format import Manifest
from .format.reading import read_manifest
from .options import ReadOptions
from .read_executor import Dest, ReadDests, ReadStats, reader_of
from .storage import Storage


class CheckpointSource(Protocol):
    """A checkpoint seen through the read executor."""

    format: str
    manifest: Manifest

    def read_dests(self, dests: list[Dest], stats: ReadStats) -> None: ...


@dataclass
class SnapshardSource:
    """A snapshard checkpoint (format v1 or v2)."""

    storage: Storage
    manifest: Manifest
    options: ReadOptions
    format: str = "snapshard"

    def read_dests(self, dests: list[Dest], stats: ReadStats) -> None:
        reader_of(self.storage, self.manifest, self.options, stats)(dests)


def open_source(storage: Storage, options: ReadOptions) -> CheckpointSource:
    """The checkpoint at `storage`: snapshard's, else one of another library (Orbax)."""
    try:
        return SnapshardSource(storage, read_manifest(storage), options)
    except CheckpointNotFoundError as e:
        from .interop import open_foreign

        return open_foreign(storage, e)


def open_checkpoint(
    storage: Storage, options: ReadOptions, stats: ReadStats
) -> tuple[Manifest, ReadDests]:
    """The checkpoint's manifest and the reader that fills buffers from it into `stats`."""
    source = open_source(storage, options)
    return source.manifest, lambda dests: source.read_dests(dests, stats)
