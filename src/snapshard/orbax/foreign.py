"""Checkpoints of other libraries, and tools that read any checkpoint box by box.

`open_foreign` is the hook through which `snapshard.load` and `snapshard.metadata` read a
checkpoint written by Orbax: it returns the checkpoint's tree as a snapshard manifest and a
reader that fills the restore path's buffers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import CheckpointNotFoundError, SnapshardError
from ..storage.location import parse_location

if TYPE_CHECKING:
    from ..storage import Storage
    from .reader import OrbaxCheckpoint

ORBAX_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA")


# Where TensorStore can read an Orbax checkpoint from (see reader.kvstore_spec).
ORBAX_SCHEMES = ("", "file", "s3", "gs")


def looks_like_orbax(local_dir: str) -> bool:
    """Whether a local directory holds Orbax's metadata files (no TensorStore needed)."""
    return any(os.path.exists(os.path.join(local_dir, m)) for m in ORBAX_MARKERS)


def holds_orbax_markers(storage: Storage) -> bool:
    """Whether an object-store location holds Orbax's metadata files (through snapshard's
    own client, whose errors name the store and what to set)."""
    from ..storage.objstore import ObjectStorage

    return not isinstance(storage, ObjectStorage) or any(storage.holds(m) for m in ORBAX_MARKERS)


def open_foreign(storage: Storage, not_found: CheckpointNotFoundError) -> OrbaxCheckpoint:
    """The Orbax checkpoint at the storage's location; `not_found` again when there is none."""
    location = storage.url
    parsed = parse_location(location)
    local = parsed.local_path
    if parsed.scheme not in ORBAX_SCHEMES or (local is not None and not os.path.isdir(local)):
        raise not_found
    if local is None and not holds_orbax_markers(storage):
        raise not_found  # never ask TensorStore: where it has no credentials it waits long
    try:
        from .reader import open_orbax  # TensorStore is an optional dependency
    except ImportError:
        if local is not None and looks_like_orbax(local):
            raise SnapshardError(
                f"{location} is an Orbax checkpoint; reading it needs TensorStore "
                "(pip install 'snapshard[orbax]')"
            ) from None
        raise not_found from None
    checkpoint = open_orbax(location)
    if checkpoint is None:
        raise not_found
    return checkpoint
