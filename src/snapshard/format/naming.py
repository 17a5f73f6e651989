"""The names of the format: the format and version tags, the manifest, and the data,
record and values files each process writes (see docs/format.md). Pure: no I/O here."""

from __future__ import annotations

import re
from typing import Any

from ..errors import CorruptCheckpointError

FORMAT_NAME = "snapshard"
FORMAT_VERSION = 2
# 2.1 binds every checksum to its file (format.binding). The manifest states it as the
# string "2.1": a reader of 2.0 refuses it by name instead of failing every checksum.
FORMAT_MINOR = 1
# 2.2 adds the leaf map of a save whose processes' trees differ (format.leaf_map); a save of
# one tree on every process stays 2.1, which readers of 2.1 read.
LEAF_MAP_MINOR = 2
READ_VERSIONS: tuple[int | str, ...] = (1, 2, "2.1", "2.2")
MANIFEST_NAME = "manifest.json"
# Beside the manifest of a step kept only for the files later steps refer to (its other
# files trimmed: manager/references.py): no checkpoint to read
RETAINED_MARKER = "RETAINED"
DATA_DIR = "data"
INDEX_DIR = "index"
_SAFE_NAME = re.compile(r"(data|index)/[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
NONCE = re.compile(r"[0-9a-f]{8}")
# The checksum of a v2 manifest is the crc32c of the file with its 8 digits as zeros.
CHECKSUM_KEY = b'"checksum":"'


def data_file_name(process: int, nonce: str, number: int) -> str:
    return f"{DATA_DIR}/p{process:05d}-{nonce}-{number}.bin"


def record_file_name(process: int, nonce: str) -> str:
    return f"{INDEX_DIR}/p{process:05d}-{nonce}.idx"


def values_file_name(process: int, nonce: str) -> str:
    return f"{INDEX_DIR}/p{process:05d}-{nonce}.values.json"


def file_nonce(name: str) -> str | None:
    """The nonce of the save that wrote a data, record or values file (None: another name)."""
    found = _SAVED_FILE.match(name)
    return found.group(1) if found else None


_SAVED_FILE = re.compile(rf"(?:{DATA_DIR}|{INDEX_DIR})/p[0-9]+-([0-9a-f]{{8}})")


def tree_file_name(digest: str) -> str:
    """A tree of a save of differing trees, named by its content's digest: every process of
    that tree writes the same bytes to it, the committer reads it and removes it before the
    commit (never part of a committed checkpoint)."""
    return f"{INDEX_DIR}/tree-{digest}.json"


def check_file_name(name: Any, where: str) -> str:
    """A data or index file name from a manifest, refusing anything that could leave the checkpoint."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise CorruptCheckpointError(f"{where}: unsafe or malformed file name {name!r}")
    return name
