"""Storage backends, chosen by the location's URL scheme."""

from __future__ import annotations

import os

from .base import CheckpointRoot, FileWriter, Storage
from .local import LocalRoot, LocalStorage
from .location import (
    OBJECT_STORE_SCHEMES,
    ParsedLocation,
    parse_location,
    require_supported,
)

Location = str | os.PathLike[str]


def is_object_store_url(location: Location) -> bool:
    return parse_location(location).is_object_store


def _local_or_object(location: Location) -> tuple[str, bool]:
    """The location as text (a plain path for file://), and whether it is an object store."""
    loc = require_supported(parse_location(location))
    return (loc.text, True) if loc.is_object_store else (loc.path, False)


def storage_for(location: Location | Storage) -> Storage:
    """The storage of a checkpoint location: a local path, file://, or an object-store URL."""
    if isinstance(location, Storage):
        return location
    text, remote = _local_or_object(location)
    if remote:
        from .objstore import ObjectStorage  # optional dependency

        return ObjectStorage(text)
    return LocalStorage(text)


def root_for(location: Location | CheckpointRoot) -> CheckpointRoot:
    """The root of several checkpoints (a manager's directory)."""
    if isinstance(location, CheckpointRoot):
        return location
    text, remote = _local_or_object(location)
    if remote:
        from .objstore import ObjectRoot  # optional dependency

        return ObjectRoot(text)
    return LocalRoot(text)


__all__ = [
    "OBJECT_STORE_SCHEMES",
    "CheckpointRoot",
    "FileWriter",
    "LocalRoot",
    "LocalStorage",
    "Location",
    "ParsedLocation",
    "Storage",
    "is_object_store_url",
    "parse_location",
    "root_for",
    "storage_for",
]
