"""Format v2 references: the manifest's `refs` list, files of other committed checkpoints
under the same parent that chunk records point to (record flag FLAG_REFERENCE).

Entry k is `{"checkpoint": name, "file": "data/…", "size": int}` or `null` (a slot no chunk
uses). A reader sees entry k as file `len(own files) + k` of the manifest's file list, named
`../<checkpoint>/<file>`: every storage backend resolves such a name inside its parent (a
sibling directory, or a sibling prefix on an object store). Pure: no I/O here.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import CorruptCheckpointError
from .binding import name_key
from .bounds import MAX_BYTES, bounded_int
from .files import FileEntry
from .naming import check_file_name

REF_PREFIX = "../"
_CHECKPOINT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}")


def check_checkpoint_name(name: Any, where: str) -> str:
    if (
        not isinstance(name, str)
        or not _CHECKPOINT.fullmatch(name)
        or ".." in name
        or ".snapshard-" in name
    ):
        raise CorruptCheckpointError(f"{where}: malformed referenced checkpoint {name!r}")
    return name


def ref_name(checkpoint: str, file: str) -> str:
    """The name under which a checkpoint's storage reads a sibling checkpoint's file."""
    return f"{REF_PREFIX}{checkpoint}/{file}"


def split_ref_name(name: str) -> tuple[str, str] | None:
    """(checkpoint, file) of a reference name, None for the checkpoint's own files."""
    if not name.startswith(REF_PREFIX):
        return None
    checkpoint, _, file = name[len(REF_PREFIX) :].partition("/")
    return checkpoint, file


def ref_files(refs: list[Any], where: str, bound: bool) -> list[FileEntry]:
    """The referenced files as manifest file entries (a null slot: an empty placeholder that
    no chunk can lie in); `bound` (2.1): with the key of the name the base gave the file,
    to which the base bound its checksums (format.binding)."""
    out = []
    for r in refs:
        if r is None:
            out.append(FileEntry("", 0))
            continue
        if not isinstance(r, dict):
            raise CorruptCheckpointError(f"{where}: malformed reference {str(r)[:200]}")
        cp = check_checkpoint_name(r.get("checkpoint"), where)
        file = check_file_name(r.get("file"), where)
        if not file.startswith("data/"):
            raise CorruptCheckpointError(f"{where}: a reference names {file!r}, not a data file")
        size = bounded_int(r.get("size"), 0, MAX_BYTES, "size", where)
        out.append(FileEntry(ref_name(cp, file), size, name_key(file) if bound else None))
    return out


def referenced_files(refs: list[Any]) -> set[tuple[str, str]]:
    """(checkpoint, file) of every used reference slot."""
    return {(r["checkpoint"], r["file"]) for r in refs if isinstance(r, dict)}
