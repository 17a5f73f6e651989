"""The on-disk format, version 1 (documented in docs/format.md)."""

from .manifest import (
    DATA_DIR,
    FORMAT_VERSION,
    INDEX_DIR,
    MANIFEST_NAME,
    ArrayLeaf,
    ChunkTable,
    FileEntry,
    Leaf,
    Manifest,
    ProcessIndex,
    ValueLeaf,
    checksum_block,
)
from .validate import validate_coverage, validate_structure

__all__ = [
    "DATA_DIR",
    "FORMAT_VERSION",
    "INDEX_DIR",
    "MANIFEST_NAME",
    "ArrayLeaf",
    "ChunkTable",
    "FileEntry",
    "Leaf",
    "Manifest",
    "ProcessIndex",
    "ValueLeaf",
    "checksum_block",
    "validate_coverage",
    "validate_structure",
]
