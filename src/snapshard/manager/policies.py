"""Small composable policies: when to save, which saved steps to keep, how preemption is
noticed, and the writer lease; ManagerPolicies bundles them for a CheckpointManager.

A save policy answers `should_save(step)`. Retention policies each name the steps they
want kept; a step survives if any policy keeps it, and the newest committed step always
survives. Everything else is deleted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..storage.lease import DEFAULT_LEASE_TIMEOUT_S


@dataclass(frozen=True)
class StepInfo:
    """A committed step as the retention policies see it."""

    step: int
    metrics: Mapping[str, Any] | None = None
    time: float = 0.0


class SavePolicy(Protocol):
    def should_save(self, step: int) -> bool: ...


@dataclass(frozen=True)
class EveryNSteps:
    """Save every `n` steps (steps divisible by n)."""

    n: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"save interval must be at least 1 step, got {self.n}")

    def should_save(self, step: int) -> bool:
        return step % self.n == 0


@dataclass(frozen=True)
class AtSteps:
    """Save at exactly these steps."""

    steps: frozenset[int]

    def should_save(self, step: int) -> bool:
        return step in self.steps


@dataclass(frozen=True)
class AnyOf:
    """Save when any of the policies says so."""

    policies: tuple[SavePolicy, ...]

    def should_save(self, step: int) -> bool:
        return any(p.should_save(step) for p in self.policies)


class RetentionPolicy(Protocol):
    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        """The steps (of `steps`, sorted ascending) this policy wants kept."""
        ...


@dataclass(frozen=True)
class KeepLatest:
    n: int

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps[-self.n :]} if self.n > 0 else set()


@dataclass(frozen=True)
class KeepEvery:
    """Keep steps divisible by `period` forever (Orbax's keep_period)."""

    period: int

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps if s.step % self.period == 0}


@dataclass(frozen=True)
class KeepBest:
    """Keep the `n` best steps by `fn(metrics)`; steps saved without metrics are kept too."""

    n: int
    fn: Callable[[Mapping[str, Any]], float]
    mode: str = "max"
    keep_unranked: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.mode!r}")

    def rank(self, steps: Sequence[StepInfo]) -> list[StepInfo]:
        """Steps with metrics, best first (ties: the newer step first)."""
        ranked = [s for s in steps if s.metrics is not None and not math.isnan(self.fn(s.metrics))]
        sign = -1.0 if self.mode == "max" else 1.0
        return sorted(ranked, key=lambda s: (sign * self.fn(s.metrics or {}), -s.step))

    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        kept = {s.step for s in self.rank(steps)[: self.n]}
        if self.keep_unranked:
            kept |= {s.step for s in steps if s.metrics is None}
        return kept


@dataclass(frozen=True)
class KeepAll:
    def keep(self, steps: Sequence[StepInfo]) -> set[int]:
        return {s.step for s in steps}


@dataclass(frozen=True)
class Retention:
    """The union of several retention policies; the newest step is always kept."""

    policies: tuple[RetentionPolicy, ...] = field(default_factory=lambda: (KeepAll(),))

    def to_delete(self, steps: Iterable[StepInfo]) -> list[int]:
        ordered = sorted(steps, key=lambda s: s.step)
        if not ordered:
            return []
        kept = {ordered[-1].step}
        for p in self.policies:
            kept |= p.keep(ordered)
        return [s.step for s in ordered if s.step not in kept]


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal time between checkpoints: sqrt(2 · C · MTBF)."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError("the checkpoint cost must be >= 0 and the MTBF > 0")
    return math.sqrt(2.0 * cost_s * mtbf_s)


@dataclass(frozen=True)
class PreemptionPolicy:
    """How a CheckpointManager learns of a preemption. `handle_sigterm`: a SIGTERM makes
    `reached_preemption` true, on every process at one step (where JAX's preemption
    service runs, leave SIGTERM to it). `notify_preemption()` works either way."""

    handle_sigterm: bool = False


@dataclass(frozen=True)
class LeasePolicy:
    """The directory's writer lease (see storage/lease.py), which process 0 takes at the
    manager's first save (then it removes what crashed saves left behind) and gives up in
    `close`; a manager that only restores and lists never takes it, so it works beside a
    live writer. `at_start=True` takes it when the manager is made instead: a training job
    that would rather learn of another writer before it trains than at its first save.
    A lease whose holder stopped its heartbeat for `timeout_s` is taken over;
    `takeover=True` takes it whatever its state."""

    timeout_s: float = DEFAULT_LEASE_TIMEOUT_S  # (checked by the lease)
    takeover: bool = False
    at_start: bool = False


@dataclass(frozen=True)
class ManagerPolicies:
    """What a CheckpointManager does beyond its common keywords. `save`: when `should_save`
    is true (EveryNSteps, AtSteps, AnyOf, or your own SavePolicy), in place of
    `save_interval_steps`; `retention`: which steps to keep (KeepLatest, KeepBest,
    KeepEvery, KeepAll: a step survives if any keeps it), in place of `max_to_keep`;
    `preemption` and `lease` as their classes say."""

    save: SavePolicy | None = None
    retention: tuple[RetentionPolicy, ...] | None = None
    preemption: PreemptionPolicy = PreemptionPolicy()
    lease: LeasePolicy = LeasePolicy()

    def __post_init__(self) -> None:
        if self.retention is not None and not isinstance(self.retention, tuple):
            # a list or a single policy: stored as a tuple (the dataclass is frozen)
            r = self.retention
            object.__setattr__(self, "retention", tuple(r) if isinstance(r, list) else (r,))

    def save_policy(self, save_interval_steps: int) -> SavePolicy:
        """The save policy, given the manager's `save_interval_steps` (one of the two)."""
        if self.save is None:
            return EveryNSteps(save_interval_steps)
        if save_interval_steps != 1:
            raise ValueError("give save_interval_steps or ManagerPolicies(save=...), not both")
        return self.save

    def retention_of(self, max_to_keep: int | None) -> Retention:
        """The retention, given the manager's `max_to_keep` (one of the two)."""
        if self.retention is None:
            return Retention((KeepLatest(max_to_keep),)) if max_to_keep is not None else Retention()
        if max_to_keep is not None:
            raise ValueError("give max_to_keep or ManagerPolicies(retention=...), not both")
        return Retention(self.retention) if self.retention else Retention()

    def best(self) -> KeepBest | None:
        """The ranking of `best_step`: the first KeepBest of the retention, if any."""
        ranking = next((p for p in self.retention or () if isinstance(p, KeepBest)), None)
        return replace(ranking, n=1) if ranking is not None else None
