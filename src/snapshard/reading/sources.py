"""Where a restore's bytes come from: one interface for snapshard, Orbax and safetensors
checkpoints, so that the restore never imports the readers of other formats, nor they it.

A `CheckpointSource` fills the read executor's host buffers (`read_dests`) and says which
boxes of an array its writers held (`saved_boxes`, which read-once planning uses). A
`TreeSource` also has a manifest: the saved tree and its leaves, as snapshard's format
describes them. snapshard checkpoints are read by the executor itself; Orbax checkpoints
through TensorStore (orbax/reader.py); safetensors files, which have no saved tree (a load
names the tensors it wants), by byte ranges (safetensors.source).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NoReturn, Protocol

import numpy as np

from ..errors import CheckpointNotFoundError
from ..format import ArrayLeaf, Manifest
from ..format.finder import ChunkFinder, detach_lazy_tables
from ..format.reading import read_checkpoint
from ..options import ReadOptions, require
from ..storage import Location, Storage, storage_for
from . import Dest, ReadDests, ReadStats, reader_of, saved_boxes


class CheckpointSource(Protocol):
    """A checkpoint seen through the read executor: `format` names it ("snapshard",
    "orbax", "safetensors")."""

    format: str

    def read_dests(self, dests: list[Dest], stats: ReadStats) -> None:
        """Fill the dests' buffers from the checkpoint, counting into `stats`."""
        ...

    def saved_boxes(self, leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
        """(starts, stops) of the boxes the writers of `leaf` held; None where not known
        without reading more."""
        ...


class TreeSource(CheckpointSource, Protocol):
    """A checkpoint that saved a tree (snapshard's, Orbax's), described by its manifest."""

    manifest: Manifest


@dataclass
class SnapshardSource:
    """A snapshard checkpoint (format v1 or v2). v2: `finder` fetches its chunk records
    (format.reading.read_checkpoint's, which its lazy tables share; None: one of its own)."""

    storage: Storage
    manifest: Manifest
    options: ReadOptions
    finder: ChunkFinder | None = field(default=None, repr=False)
    format: str = "snapshard"

    def __post_init__(self) -> None:
        if self.finder is None and self.manifest.version >= 2:
            self.finder = ChunkFinder(self.storage, self.manifest)

    def read_dests(self, dests: list[Dest], stats: ReadStats) -> None:
        reader_of(self.storage, self.manifest, self.finder, self.options, stats)(dests)

    def saved_boxes(self, leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
        return saved_boxes(self.manifest, self.finder, leaf)

    def release(self) -> None:
        """A load is done with it: its leaves' lazy tables let go of the finder (and so of
        the storage and its connections), which they would otherwise hold in reference
        cycles (leaf, table, loader) that only the cyclic collector frees."""
        detach_lazy_tables(self.manifest)


def open_source(storage: Storage, options: ReadOptions) -> TreeSource:
    """The checkpoint at `storage`: snapshard's, else one of another library (Orbax)."""
    try:
        manifest, finder = read_checkpoint(storage)
        return SnapshardSource(storage, manifest, options, finder)
    except CheckpointNotFoundError as e:
        from ..orbax.foreign import open_foreign

        return open_foreign(storage, e)


def open_checkpoint(
    storage: Storage, options: ReadOptions, stats: ReadStats
) -> tuple[TreeSource, ReadDests]:
    """The checkpoint's source and the reader that fills buffers from it into `stats`."""
    source = open_source(storage, options)
    return source, lambda dests: source.read_dests(dests, stats)


@contextmanager
def open_for_load(
    directory: Location | Storage,
    options: ReadOptions,
    stats: ReadStats,
    refused: Callable[[str, Exception], NoReturn] | None = None,
) -> Iterator[tuple[Storage, TreeSource, ReadDests]]:
    """What every load of a saved tree begins and ends with: the options checked, the
    storage opened (and closed after, where opened here), the checkpoint's source and the
    reader that fills buffers from it into `stats`; at the end, the load's whole time in
    `stats.total_s`. A checkpoint that cannot be opened (deleted, access refused) goes to
    `refused(url, error)`, which raises it: a wing's multi-process load tells the other
    processes there (read_once_policy.refuse_target) rather than leave them waiting."""
    require(options, ReadOptions)
    t_start = time.perf_counter()
    owns = not isinstance(directory, Storage)
    storage = storage_for(directory)
    try:
        try:
            source, read = open_checkpoint(storage, options, stats)
        except Exception as e:
            if refused is None:
                raise
            refused(storage.url, e)
        try:
            yield storage, source, read
        finally:
            if isinstance(source, SnapshardSource):
                source.release()
    finally:
        if owns:
            storage.close()
        stats.total_s = time.perf_counter() - t_start
