"""The chunk tables a batch reads from, and the readers of a checkpoint built on them.

A snapshard v2 checkpoint's tables come from its chunk records, fetched through the chunk
finder for the boxes a batch needs (`chunk_tables`); v1 checkpoints and other formats carry
them on their leaves. `reader_of` and `table_reader` are the `ReadDests` of a snapshard
checkpoint and of tables in memory; `saved_boxes` says which boxes the writers held, for
read-once planning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..format import ArrayLeaf, ChunkTable, FileEntry, Manifest
from ..format.finder import ChunkFinder, loaded_table
from ..options import ReadOptions
from ..storage import Storage
from .buffers import Dest, ReadDests, ReadStats
from .reads import read_batch

# The boxes the processes that saved an array held, as (n, ndim) starts and stops (None:
# unknown); read-once restores take it to tell whether a target cuts the saved rows.
SavedBoxes = Callable[[ArrayLeaf], tuple[np.ndarray, np.ndarray] | None]


def saved_boxes(
    manifest: Manifest, finder: ChunkFinder | None, leaf: ArrayLeaf
) -> tuple[np.ndarray, np.ndarray] | None:
    """The boxes the processes that saved `leaf` held: from its layout (v2, through the
    checkpoint's `finder`), else its chunks (v1, safetensors files; None: not known without
    reading records)."""
    if manifest.version >= 2 and leaf.layout is not None:
        if finder is None:
            return None
        groups = finder.holders.groups(leaf)
        return groups.starts, groups.stops
    return chunk_boxes(leaf)


def chunk_boxes(leaf: ArrayLeaf) -> tuple[np.ndarray, np.ndarray] | None:
    """The boxes of the chunk table a leaf holds in memory (None: it has none)."""
    t = leaf.chunks
    return (t.starts, t.stops) if len(t) else None


def chunk_tables(
    finder: ChunkFinder | None, dests: list[Dest], stats: ReadStats
) -> dict[int, ChunkTable]:
    """The chunk table of every leaf the dests belong to: from the manifest (v1, other
    formats, or a v2 table already fetched), else only the records the dests need (v2)."""
    tables: dict[int, ChunkTable] = {}
    wants: dict[int, tuple[ArrayLeaf, list[tuple[np.ndarray, np.ndarray]]]] = {}
    for d in dests:
        if id(d.leaf) in tables:
            continue
        t = loaded_table(d.leaf) if finder is not None else d.leaf.chunks
        if t is not None:
            tables[id(d.leaf)] = t
        else:
            wants.setdefault(id(d.leaf), (d.leaf, []))[1].append((d.start, d.stop))
    if wants:
        assert finder is not None
        before = finder.records.metadata_bytes
        tables.update(finder.tables(list(wants.values())))
        stats.metadata_bytes += finder.records.metadata_bytes - before
    return tables


def reader_of(
    storage: Storage,
    manifest: Manifest,
    finder: ChunkFinder | None,
    options: ReadOptions,
    stats: ReadStats,
) -> ReadDests:
    """The restore's reads of a snapshard checkpoint as a ReadDests (`options`: verify,
    threads, max_gap); v2 chunk records are fetched as the dests need them, through
    `finder` (format.reading.read_checkpoint's; None: a finder of this reader's own)."""
    if manifest.version < 2:
        finder = None
    elif finder is None:
        finder = ChunkFinder(storage, manifest)
    files = manifest.files
    return lambda dests: read_batch(
        storage, files, chunk_tables(finder, dests, stats), dests, options, stats
    )


def table_reader(
    storage: Storage, files: Sequence[FileEntry], options: ReadOptions, stats: ReadStats
) -> ReadDests:
    """The reads of arrays whose chunk tables are in memory (`leaf.chunks`, numbering
    `files`): sources of other formats (safetensors files)."""
    return lambda dests: read_batch(
        storage, files, chunk_tables(None, dests, stats), dests, options, stats
    )
