"""Numbered steps with save and retention policies."""

from .framework import JAX, Framework, StartedSave
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
from .tier_config import LocalTier

__all__ = [
    "JAX",
    "AnyOf",
    "AtSteps",
    "BackgroundSaveError",
    "CheckpointManager",
    "EveryNSteps",
    "Framework",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLatest",
    "LocalTier",
    "Retention",
    "RetentionPolicy",
    "SavePolicy",
    "StartedSave",
    "StepInfo",
    "young_daly_interval",
]
