"""Numbered steps with save, retention, preemption and lease policies."""

from .framework import Framework, StartedSave
from .manager import CheckpointManager
from .policies import (
    AnyOf,
    AtSteps,
    EveryNSteps,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepLatest,
    LeasePolicy,
    ManagerPolicies,
    PreemptionPolicy,
    Retention,
    RetentionPolicy,
    SavePolicy,
    StepInfo,
    young_daly_interval,
)
from .tier_config import LocalTier
from .writer import BackgroundSaveError

__all__ = [
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
    "LeasePolicy",
    "LocalTier",
    "ManagerPolicies",
    "PreemptionPolicy",
    "Retention",
    "RetentionPolicy",
    "SavePolicy",
    "StartedSave",
    "StepInfo",
    "young_daly_interval",
]
