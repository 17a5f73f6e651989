"""snapshard: distributed checkpointing of sharded JAX training state.

    snapshard.save(path, tree)                 # every process, same tree; atomic
    tree = snapshard.load(path, target)        # onto any mesh / process count, or NumPy
    snapshard.metadata(path)                   # shapes, dtypes, shardings; no data read
    snapshard.save(path, tree, snapshard.SaveOptions(compression="zstd"))  # how to write
    snapshard.load(path, target, snapshard.ReadOptions(threads=8))        # how to read

Names are imported on first use, so that the pure parts (snapshard.planning,
snapshard.format) can be imported without JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CoordinationError,
    CorruptCheckpointError,
    DeletedArrayError,
    SnapshardError,
    StorageError,
    TargetMismatchError,
    UnsupportedLeafError,
    ValidationError,
    WriterLeaseError,
)
from .lazy import lazy_getattr

if TYPE_CHECKING:
    from .inspection import ArrayMetadata, ValueMetadata, metadata
    from .jax.load import load
    from .jax.targets import abstract_target
    from .manager import BackgroundSaveError, CheckpointManager, LocalTier
    from .options import ReadOptions, SaveOptions
    from .per_process import PerProcess
    from .reading import ReadStats
    from .saving import AsyncSave, SaveTimings, save, save_async

__version__ = "0.1.0"

_LAZY = {
    "abstract_target": "jax.targets",
    "ArrayMetadata": "inspection",
    "ValueMetadata": "inspection",
    "metadata": "inspection",
    "BackgroundSaveError": "manager",
    "CheckpointManager": "manager",
    "LocalTier": "manager",
    "ReadOptions": "options",
    "SaveOptions": "options",
    "PerProcess": "per_process",
    "ReadStats": "reading",
    "load": "jax.load",
    "AsyncSave": "saving",
    "SaveTimings": "saving",
    "save": "saving",
    "save_async": "saving",
}


_lazy = lazy_getattr(__name__, _LAZY)

# The JAX-default entry points: the JAX wing registers its seams with the core (the default
# save adapter and coordinator) before the save executor is reached through them.
_JAX_DEFAULT = frozenset({"save", "save_async", "AsyncSave", "CheckpointManager"})


def __getattr__(name: str) -> Any:
    if name in _JAX_DEFAULT:
        importlib.import_module(".jax", __name__)
    return _lazy(name)


__all__ = [
    "ArrayMetadata",
    "AsyncSave",
    "BackgroundSaveError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CoordinationError",
    "CorruptCheckpointError",
    "DeletedArrayError",
    "LocalTier",
    "PerProcess",
    "ReadOptions",
    "ReadStats",
    "SaveOptions",
    "SaveTimings",
    "SnapshardError",
    "StorageError",
    "TargetMismatchError",
    "UnsupportedLeafError",
    "ValidationError",
    "ValueMetadata",
    "WriterLeaseError",
    "__version__",
    "abstract_target",
    "load",
    "metadata",
    "save",
    "save_async",
]
