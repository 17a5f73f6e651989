"""Storage backends, chosen by the location's URL scheme."""

from __future__ import annotations

import os
from urllib.parse import urlparse

from .base import CheckpointRoot, FileWriter, Storage
from .local import LocalRoot, LocalStorage

Location = str | os.PathLike[str]
OBJECT_STORE_SCHEMES = ("s3", "gs", "az", "azure", "abfs", "memory")


def is_object_store_url(location: Location) -> bool:
    return urlparse(os.fspath(location)).scheme in OBJECT_STORE_SCHEMES


def _local_or_object(location: Location) -> tuple[str, bool]:
    """The location as text (a plain path for file://), and whether it is an object store."""
    text = os.fspath(location)
    scheme = urlparse(text).scheme
    if scheme in ("", "file"):
        return (urlparse(text).path if scheme == "file" else text), False
    if scheme in OBJECT_STORE_SCHEMES:
        return text, True
    raise ValueError(f"unsupported checkpoint location {text!r} (scheme {scheme!r})")


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
    "CheckpointRoot",
    "FileWriter",
    "LocalRoot",
    "LocalStorage",
    "Location",
    "Storage",
    "is_object_store_url",
    "root_for",
    "storage_for",
]
