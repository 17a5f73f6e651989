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


def storage_for(location: Location | Storage) -> Storage:
    """The storage of a checkpoint location: a local path, file://, or an object-store URL."""
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    scheme = urlparse(text).scheme
    if scheme in ("", "file"):
        return LocalStorage(urlparse(text).path if scheme == "file" else text)
    if scheme in OBJECT_STORE_SCHEMES:
        from .objstore import ObjectStorage  # optional dependency

        return ObjectStorage(text)
    raise ValueError(f"unsupported checkpoint location {text!r} (scheme {scheme!r})")


def root_for(location: Location | CheckpointRoot) -> CheckpointRoot:
    """The root of several checkpoints (a manager's directory)."""
    if isinstance(location, CheckpointRoot):
        return location
    text = os.fspath(location)
    scheme = urlparse(text).scheme
    if scheme in ("", "file"):
        return LocalRoot(urlparse(text).path if scheme == "file" else text)
    if scheme in OBJECT_STORE_SCHEMES:
        from .objstore import ObjectRoot  # optional dependency

        return ObjectRoot(text)
    raise ValueError(f"unsupported checkpoint location {text!r} (scheme {scheme!r})")


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
