"""The on-disk format (documented in docs/format.md): 2.1 written; 1, 2.0 and 2.1 read."""

from . import records
from .chunks import ChunkTable, checksum_block
from .files import FileEntry, ProcessTable
from .leaves import ArrayLeaf, Leaf, ValueLeaf
from .manifest import Manifest
from .naming import DATA_DIR, INDEX_DIR, MANIFEST_NAME, data_file_name, record_file_name
from .validate import validate_coverage, validate_structure

__all__ = [
    "DATA_DIR",
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
