"""snapshard: distributed checkpointing of sharded JAX training state.

snapshard.save(path, tree)                 # every process, same tree; atomic
tree = snapshard.load(path, target)        # onto any mesh / process count, or NumPy
snapshard.metadata(path)                   # shapes, dtypes, shardings; no data read
"""

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CoordinationError,
    CorruptCheckpointError,
    SnapshardError,
    StorageError,
    TargetMismatchError,
    UnsupportedLeafError,
    ValidationError,
)
from .manager import BackgroundSaveError, CheckpointManager, LocalTier
from .metadata import ArrayMetadata, ValueMetadata, metadata
from .restore import ReadStats, load
from .save import AsyncSave, SaveTimings, save, save_async

__version__ = "0.1.0"

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
    "LocalTier",
    "ReadStats",
    "SaveTimings",
    "SnapshardError",
    "StorageError",
    "TargetMismatchError",
    "UnsupportedLeafError",
    "ValidationError",
    "ValueMetadata",
    "__version__",
    "load",
    "metadata",
    "save",
    "save_async",
]
