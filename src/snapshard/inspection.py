"""What a checkpoint holds, read from its manifest alone (no array data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import CheckpointNotFoundError
from .format import ArrayLeaf
from .format.kinds import LeafKind
from .format.reading import read_manifest
from .storage import Location, Storage, storage_for
from .tree import unflatten


@dataclass(frozen=True)
class ArrayMetadata:
    """A saved array: shape and dtype as the user sees them, bytes stored, saved sharding."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    sharding: dict[str, Any] | None
    kind: str  # "array", "scalar" or "prng_key"
    chunks: int
    key_impl: str | None = None


@dataclass(frozen=True)
class ValueMetadata:
    """A Python value stored in the manifest."""

    value: Any


def leaf_metadata(leaf: Any) -> ArrayMetadata | ValueMetadata:
    if isinstance(leaf, ArrayLeaf):
        dtype = f"key<{leaf.key_impl}>" if leaf.kind == LeafKind.PRNG_KEY else leaf.dtype
        return ArrayMetadata(
            shape=leaf.logical_shape,
            dtype=dtype,
            nbytes=leaf.nbytes,
            sharding=leaf.sharding,
            kind=leaf.kind,
            chunks=leaf.num_chunks,
            key_impl=leaf.key_impl,
        )
    return ValueMetadata(leaf.value)


def metadata(directory: Location | Storage) -> Any:
    """The saved tree, with an ArrayMetadata or ValueMetadata at every leaf."""
    storage = storage_for(directory)
    try:
        manifest = read_manifest(storage)
    except CheckpointNotFoundError as e:
        from .orbax.foreign import open_foreign

        manifest = open_foreign(storage, e).manifest
    finally:
        storage.close()
    return unflatten(manifest.structure, lambda i: leaf_metadata(manifest.leaves[i]))
