"""Numbered steps with save and retention policies."""

from .local_tier import LocalTier
from .manager import BackgroundSaveError, CheckpointManager
from .policies import (
    AnyOf,
    AtSteps,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    Retention,
    RetentionPolicy,
    SavePolicy,
    StepInfo,
    young_daly_interval,
)

__all__ = [
    "AnyOf",
    "AtSteps",
    "BackgroundSaveError",
    "CheckpointManager",
    "EveryNSteps",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "LocalTier",
    "Retention",
    "RetentionPolicy",
    "SavePolicy",
    "StepInfo",
    "young_daly_interval",
]
