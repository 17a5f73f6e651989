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

from typing import TYPE_CHECKING

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
    from .adapters.targets import abstract_target
    from .inspection import ArrayMetadata, ValueMetadata, metadata
    from .manager import BackgroundSaveError, CheckpointManager, LocalTier
    from .options import ReadOptions, SaveOptions
    from .per_process import PerProcess
    from .reading import ReadStats
    from .restore import load
    from .saving import AsyncSave, SaveTimings, save, save_async

__version__ = "0.1.0"

_LAZY = {
    "abstract_target": "adapters.targets",
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
    "load": "restore",
    "AsyncSave": "saving",
    "SaveTimings": "saving",
    "save": "saving",
    "save_async": "saving",
}


__getattr__ = lazy_getattr(__name__, _LAZY)


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
