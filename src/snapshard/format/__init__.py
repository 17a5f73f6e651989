"""The on-disk format (documented in docs/format.md): 2.1 written; 1, 2.0 and 2.1 read."""

from . import records
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
    ProcessTable,
    ValueLeaf,
    checksum_block,
    data_file_name,
    record_file_name,
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
    "ProcessTable",
    "ValueLeaf",
    "checksum_block",
    "data_file_name",
    "record_file_name",
    "records",
    "validate_coverage",
    "validate_structure",
]
