"""The chunk encoding's former home: it lives in snapshard.format.encoding (plain and
compressed chunks, written and read) and snapshard.format.compression (zstd, the codec
threads). The names below stay here for one release, for code that imports them from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .format.compression import available
from .format.encoding import (
    COMPRESSION_CODECS,
    COMPRESSIONS,
    DEFAULT_LEVEL,
    NONE,
    WINDOW,
    ZSTD,
    ZSTD_SHUFFLE,
    PackedChunk,
    codec_for,
    read_packed,
    shuffle,
    unshuffle,
)
from .format.records import codec_of

if TYPE_CHECKING:
    from .storage import Storage

__all__ = [
    "COMPRESSIONS",
    "COMPRESSION_CODECS",
    "DEFAULT_LEVEL",
    "NONE",
    "WINDOW",
    "ZSTD",
    "ZSTD_SHUFFLE",
    "available",
    "codec_for",
    "codec_of",
    "read_range",
    "shuffle",
    "unshuffle",
]


def read_range(
    storage: Storage, name: str, *, start: int, stop: int, buffers: Sequence[memoryview],
    verify: bool, leaf: str = "", chunk: int = 0, **placed: int,
) -> int:  # fmt: skip
    """format.encoding.read_packed under its former keywords (`placed`: offset, nbytes,
    block, crc_offset, codec, itemsize and key, the fields of a PackedChunk)."""
    packed = PackedChunk(name, leaf=leaf, chunk=chunk, **placed)
    return read_packed(storage, packed, start, stop, buffers, verify=verify)
