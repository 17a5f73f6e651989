"""Storage backends, chosen by the location's URL scheme."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

from .base import CheckpointRoot, FileWriter, Storage, set_opener
from .local import LocalStorage
from .local_root import LocalRoot
from .location import parse_location, require_supported

Location = str | os.PathLike[str]


def is_object_store_url(location: Location) -> bool:
    return parse_location(location).is_object_store


def storage_for(location: Location | Storage) -> Storage:
    """The storage of a checkpoint location: a local path, file://, or an object-store URL."""
    if isinstance(location, Storage):
        return location
    return _backend(location, LocalStorage, lambda url: _objstore().ObjectStorage(url))


set_opener(storage_for)  # Storage.sibling's opener (base.py cannot import the backends)


def root_for(location: Location | CheckpointRoot) -> CheckpointRoot:
    """The root of several checkpoints (a manager's directory)."""
    if isinstance(location, CheckpointRoot):
        return location
    return _backend(location, LocalRoot, lambda url: _objstore().ObjectRoot(url))


_T = TypeVar("_T")


def _backend(location: Location, local: Callable[[str], _T], remote: Callable[[str], _T]) -> _T:
    """`local` of the path (a file:// URL's path), or `remote` of an object-store URL."""
    loc = require_supported(parse_location(location))
    return remote(loc.text) if loc.is_object_store else local(loc.path)


def _objstore() -> ModuleType:
    from . import objstore  # an optional dependency: imported where a URL needs it

    return objstore


__all__ = [
    "CheckpointRoot",
    "FileWriter",
    "LocalRoot",
    "LocalStorage",
    "Location",
    "Storage",
    "is_object_store_url",
    "parse_location",
    "root_for",
    "storage_for",
]
