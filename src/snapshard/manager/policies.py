"""Small composable policies: when to save, and which saved steps to keep.

A save policy answers `should_save(step)`. Retention policies each name the steps they
want kept; a step survives if any policy keeps it, and the newest committed step always
survives. Everything else is deleted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


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
