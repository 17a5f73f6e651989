"""CheckpointManager: numbered steps under one directory, with save and retention policies.

Steps are checkpoints named by their number (`DIR/100`). Saves are asynchronous by default:
`save` returns once the owned slices are on the host; a save started while another is in
flight first waits for that one. After a commit the retention policies run and old steps are
deleted in the background by process 0 (never the newest committed step). A manager that
starts removes what crashed saves left behind (process 0, then one barrier), and never lists
incomplete steps. A background failure is logged when it happens and raised, naming the
step, by the next `save`, `wait_until_finished` or `close` (once).
"""

from __future__ import annotations

import hashlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

from ..coordination import Coordinator, default_coordinator
from ..coordination.jax_distributed import preemption_sync_point
from ..errors import CheckpointExistsError, CheckpointNotFoundError, SnapshardError
from ..restore import load, read_manifest
from ..save import DEFAULT_TIMEOUT_S, AsyncSave, SaveTimings, save_async
from ..storage import CheckpointRoot, Location, root_for
from .policies import (
    AnyOf,
    AtSteps,
    EveryNSteps,
    KeepBest,
    KeepEvery,
    KeepLatest,
    Retention,
    RetentionPolicy,
    SavePolicy,
    StepInfo,
    young_daly_interval,
)

log = logging.getLogger("snapshard")
_starts: dict[str, int] = {}
_starts_lock = threading.Lock()


class BackgroundSaveError(SnapshardError):
    """A save that ran in the background failed."""

    def __init__(self, step: int, cause: BaseException):
        self.step = step
        super().__init__(
            f"the background save of step {step} failed: {type(cause).__name__}: {cause}"
        )


class CheckpointManager:
    def __init__(
        self,
        directory: Location | CheckpointRoot,
        *,
        save_interval_steps: int = 1,
        save_on_steps: Iterable[int] = (),
        max_to_keep: int | None = None,
        keep_period: int | None = None,
        best_fn: Callable[[Mapping[str, Any]], float] | None = None,
        best_mode: str = "max",
        async_save: bool = True,
        save_policy: SavePolicy | None = None,
        retention: Sequence[RetentionPolicy] | None = None,
        coordinator: Coordinator | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        write_mode: str = "auto",
        host_budget: int | None = None,
        handle_sigterm: bool = False,
    ):
        """`save_interval_steps`, `save_on_steps`: when `should_save` is true (or pass
        `save_policy`). Retention: keep the newest `max_to_keep` steps, or with `best_fn` the
        `max_to_keep` best by `best_fn(metrics)` (`best_mode` 'max'/'min'; steps without
        metrics are kept), plus every step divisible by `keep_period` (or pass `retention`).
        `handle_sigterm`: a SIGTERM makes `reached_preemption` true (single-process jobs;
        multi-process jobs use JAX's preemption service)."""
        self._root = root_for(directory)
        self._coord = coordinator or default_coordinator()
        self._timeout_s = timeout_s
        self._write_mode = write_mode
        self._host_budget = host_budget
        self._async = async_save
        self._save_policy = save_policy or AnyOf(
            (EveryNSteps(save_interval_steps), AtSteps(frozenset(save_on_steps)))
        )
        if retention is None:
            policies: list[RetentionPolicy] = []
            if max_to_keep is not None:
                policies.append(
                    KeepBest(max_to_keep, best_fn, best_mode)
                    if best_fn
                    else KeepLatest(max_to_keep)
                )
            if keep_period is not None:
                policies.append(KeepEvery(keep_period))
            retention = policies or None
        self._retention = Retention(tuple(retention)) if retention else Retention()
        self._best = KeepBest(1, best_fn, best_mode) if best_fn else None
        self._lock = threading.Lock()
        self._inflight: tuple[int, AsyncSave] | None = None
        self._error: BaseException | None = None
        self._timings: dict[int, SaveTimings] = {}
        self._preempted = threading.Event()
        self._old_sigterm: Any = None
        if handle_sigterm:
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._cleanup_incomplete()
        self._steps: dict[int, StepInfo] = self._scan()

    # ---- start-up --------------------------------------------------------------------
    def _cleanup_incomplete(self) -> None:
        """Process 0 removes what crashed saves left; the others wait for it (one barrier)."""
        if self._coord.is_leader:
            for name, committed in self._root.list().items():
                if not committed:
                    log.info("removing incomplete checkpoint %s/%s", self._root.url, name)
                    self._root.remove_incomplete(name)
        if self._coord.process_count > 1:
            # The same name on every process without talking: they start managers in the same order.
            with _starts_lock:
                n = _starts.get(self._root.url, 0)
                _starts[self._root.url] = n + 1
            tag = hashlib.sha256(self._root.url.encode()).hexdigest()[:16]
            self._coord.barrier(f"snapshard/manager/{tag}/start/{n}", self._timeout_s)

    def _scan(self) -> dict[int, StepInfo]:
        steps = {}
        for name, committed in self._root.list().items():
            if committed and name.isdigit():
                with self._root.child(name) as storage:
                    manifest = read_manifest(storage)
                steps[int(name)] = StepInfo(
                    int(name), manifest.extra.get("metrics"), manifest.created_unix
                )
        return steps

    # ---- queries ---------------------------------------------------------------------
    @property
    def directory(self) -> str:
        return self._root.url

    def all_steps(self) -> list[int]:
        """Committed steps, ascending. Incomplete saves are never listed."""
        with self._lock:
            return sorted(self._steps)

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The best committed step by `best_fn`, or None without best_fn or metrics."""
        if self._best is None:
            return None
        with self._lock:
            ranked = self._best.rank(sorted(self._steps.values(), key=lambda s: s.step))
        return ranked[0].step if ranked else None

    def metrics(self, step: int) -> Mapping[str, Any] | None:
        with self._lock:
            return self._steps[step].metrics

    def should_save(self, step: int) -> bool:
        with self._lock:
            if step in self._steps:
                return False
        return self._save_policy.should_save(step)

    def save_timings(self) -> dict[int, SaveTimings]:
        """Per-step blocking and background durations of the saves this manager made."""
        with self._lock:
            return dict(self._timings)

    def recommended_save_interval(
        self, mtbf_s: float, *, step_time_s: float | None = None, cost: str = "blocking"
    ) -> float:
        """Young/Daly: τ = sqrt(2 · C · MTBF), C the mean measured cost of a save.

        cost='blocking' (default) takes the time the training step waits (the right C for
        asynchronous saves); 'total' the time to durable (for synchronous saves). Returns
        seconds, or steps when `step_time_s` is given."""
        timings = list(self.save_timings().values())
        if not timings:
            raise ValueError("no save has been measured yet")
        c = sum(t.blocking_s if cost == "blocking" else t.total_s for t in timings) / len(timings)
        tau = young_daly_interval(c, mtbf_s)
        return max(1.0, round(tau / step_time_s)) if step_time_s else tau

    # ---- preemption ------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._preempted.set()

    def notify_preemption(self) -> None:
        """Make `reached_preemption` true from now on (e.g. from a custom signal handler)."""
        self._preempted.set()

    def reached_preemption(self, step: int) -> bool:
        """True when the job is being preempted and this step should save and exit.

        Uses JAX's preemption sync point (all processes agree on the step) when the
        preemption service runs; otherwise a SIGTERM seen by this process or
        `notify_preemption()`."""
        try:
            if preemption_sync_point(step):
                return True
        except RuntimeError:
            pass
        return self._preempted.is_set()

    # ---- saving ----------------------------------------------------------------------
    def _raise_pending(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _wait_inflight(self) -> None:
        with self._lock:
            inflight = self._inflight
        if inflight is None:
            return
        step, handle = inflight
        try:
            handle.wait()
        except BaseException as e:
            with self._lock:
                if self._error is None:
                    self._error = BackgroundSaveError(step, e)
        finally:
            with self._lock:
                if self._inflight is inflight:
                    self._inflight = None

    def save(
        self, step: int, tree: Any, metrics: Mapping[str, Any] | None = None, force: bool = False
    ) -> bool:
        """Save `step` if the save policy (or `force`) says so; returns whether it saved.

        Waits for a save still in flight first. Raises the error of an earlier background
        save, and CheckpointExistsError for a step that is already committed."""
        self._wait_inflight()
        self._raise_pending()
        with self._lock:
            if step in self._steps:
                raise CheckpointExistsError(
                    f"step {step} already exists in {self._root.url}; it is never overwritten"
                )
        if not force and not self._save_policy.should_save(step):
            return False
        info_metrics = dict(metrics) if metrics is not None else None

        def committed(timings: SaveTimings) -> None:
            self._after_commit(step, info_metrics, timings)

        handle = save_async(
            self._root.child(str(step)),
            tree,
            mode=self._write_mode,
            timeout_s=self._timeout_s,
            coordinator=self._coord,
            host_budget=self._host_budget,
            extra={"step": step, "metrics": info_metrics},
            then=committed,
        )
        with self._lock:
            self._inflight = (step, handle)
            self._timings[step] = handle.timings
        if not self._async:
            self._wait_inflight()
            self._raise_pending()
        return True

    def _after_commit(
        self, step: int, metrics: dict[str, Any] | None, timings: SaveTimings
    ) -> None:
        """Runs in the save's thread on every process: record the step, apply retention."""
        with self._lock:
            self._steps[step] = StepInfo(step, metrics, time.time())
            doomed = self._retention.to_delete(self._steps.values())
            for s in doomed:
                del self._steps[s]
        if self._coord.is_leader:
            for s in doomed:
                self._root.child(str(s)).delete()

    def wait_until_finished(self) -> None:
        """Wait for the save in flight; raise its error (or an earlier one) if any."""
        self._wait_inflight()
        self._raise_pending()

    def restore(self, step: int | None = None, target: Any = None, **load_options: Any) -> Any:
        """Restore `step` (default: the latest committed) with snapshard.load's semantics."""
        self._wait_inflight()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed step in {self._root.url}")
        elif step not in self._steps:
            raise CheckpointNotFoundError(
                f"step {step} is not a committed step of {self._root.url}"
            )
        return load(self._root.child(str(step)), target, **load_options)

    def close(self) -> None:
        """Wait for the save in flight and raise any background error not raised yet."""
        try:
            self.wait_until_finished()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:  # don't mask the caller's exception; still wait for the save in flight
            try:
                self.close()
            except BaseException as e:
                log.error("while closing the checkpoint manager: %s", e)
