"""Every chunk table of a checkpoint in one pass, for the commands that walk every chunk.

A v2 checkpoint's chunk tables are fetched from its record files when first used, one
array at a time: at 100,000 arrays that is 100,000 small fetches. Commands that will touch
every chunk anyway (verify, diff --values) fetch them all at once: each record file's
directory and segments read in merged ranges, the tables checked as a restore checks them.
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptCheckpointError
from ..format.finder import ChunkFinder, loaded_table
from .reader import CheckpointReader


def load_all_tables(reader: CheckpointReader) -> None:
    """Give every array of a v2 snapshard checkpoint its whole chunk table (others carry
    theirs already). A table with another number of chunks than the manifest says is
    damage (CorruptCheckpointError naming the leaf)."""
    m = reader.manifest
    if reader.format != "snapshard" or m.version < 2 or reader.storage is None:
        return
    pending = [leaf for leaf in m.arrays if loaded_table(leaf) is None]
    if not pending:
        return
    finder = ChunkFinder(reader.storage, m)
    wants = [
        (leaf, [(np.zeros(len(leaf.shape), np.int64), np.asarray(leaf.shape, np.int64))])
        for leaf in pending
    ]
    tables = finder.tables(wants)
    for leaf in pending:
        t = tables[id(leaf)]
        if leaf.chunk_count is not None and len(t) != leaf.chunk_count:
            raise CorruptCheckpointError(
                f"{reader.url}, leaf {leaf.name!r}: {len(t)} chunk records found, "
                f"the manifest says {leaf.chunk_count}"
            )
        leaf.chunks = t
