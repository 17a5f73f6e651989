"""Format 2.1: the checksums a file holds are bound to the file, hence to its save.

A file's name carries its writer's nonce, random per save attempt (format.manifest). From
2.1 on, every checksum a data or record file stores is keyed by that name: a data file of
another save (or another process, or another number) renamed into place, or a chunk moved
to another offset, fails its checksums although its bytes and checksums agree with each
other. Version 2.0 stored the plain checksums: its keys are 0 (nothing to check).

- name key: `crc32c(name)` of the file's name in its checkpoint (`data/p00000-1a2b3c4d-0.bin`,
  `index/p00000-1a2b3c4d.idx`; for a reference, the `file` of its `refs` entry, the name in
  the checkpoint that wrote it).
- chunk key: `name key XOR mix(offset)`, with `mix(o) = ((o * 0x9E3779B97F4A7C15) mod 2**64)
  >> 32` (the chunk's offset in its file). A chunk's block checksums are stored XOR its key.
- record segments: the segment checksum continues from `crc32c(pack("<II", p, a), name key
  of the record file)` instead of from `crc32c(pack("<II", p, a))`.

Pure: no I/O here.
"""

from __future__ import annotations

import numpy as np

from ..checksum import crc32c

_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def name_key(name: str) -> int:
    """The key of the file named `name` (its path inside the checkpoint that wrote it)."""
    return crc32c(name.encode())


def chunk_key(file_key: int, offset: int) -> int:
    """The key a chunk at `offset` of a file with key `file_key` XORs into its checksums."""
    return file_key ^ (((offset * _MIX) & _MASK64) >> 32)


def chunk_keys(file_keys: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """chunk_key of many chunks at once (uint32): the file key of each and its offset."""
    with np.errstate(over="ignore"):  # the product is meant to wrap at 2**64
        mixed = (offsets.astype(np.uint64) * np.uint64(_MIX)) >> np.uint64(32)
    return (file_keys.astype(np.uint64) ^ mixed).astype(np.uint32)
