"""A manager's saves: the directory's writer lease, each step's save into the tiers, retention.

Only a writer changes the directory: at its first save (or when it is made,
LeasePolicy.at_start) the manager takes the directory's writer lease and removes what crashed
saves left behind (process 0, then one rendezvous); a manager that only restores and lists
takes no lease and works beside a live writer. Saves are asynchronous by default: `save`
returns once the owned slices are on the host; a save started while another is in flight
first waits for that one. After a commit the retention policies run and old steps are
deleted in the background by process 0 (never the newest committed step). A background
failure is logged when it happens and raised, naming the step, by the next `save`,
`wait_until_finished` or `close` (once). The host buffers its saves stage into are the
manager's own, reused from one save to the next and released by `close` (saving/staging.py); it
keeps the reports of its last `REPORTS_KEPT` saves, and names its saves' rendezvous under its
directory rather than each step's (saving/blocking.py), so that nothing it or the process
holds grows with the saves it makes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..background import BackgroundTask
from ..coordination import Coordinator
from ..errors import CheckpointExistsError, SnapshardError, WriterLeaseError
from ..gc_pause import Frozen
from ..options import SaveOptions, background_of
from ..saving import SaveTimings
from ..saving.blocking import failed_before, saves_counted_under
from ..saving.staging import SavePools, pools_for_saves
from ..saving.writer_process import start_writer_soon
from ..storage import CheckpointRoot, Location, root_for
from ..storage.lease import WriterLease
from ..tree import FlatTree, flatten, user_frame
from .framework import Framework, StartedSave, tier_of
from .listing import StepListing
from .policies import ManagerPolicies, StepInfo
from .references import References, identical_leaves, saved_arrays
from .tier_config import LocalTier, TierReport

log = logging.getLogger("snapshard")
REPORTS_KEPT = 100  # save_timings() and tier_reports() of the newest this many saves


class BackgroundSaveError(SnapshardError):
    """A save that ran in the background failed."""

    def __init__(self, step: int, cause: BaseException):
        self.step = step
        super().__init__(
            f"the background save of step {step} failed: {type(cause).__name__}: {cause}"
        )


def refuse_orbax_args(value: Any, call: str) -> None:
    """Orbax's args objects (`ocp.args.StandardSave`, `Composite`, ...) where a tree or a
    target belongs: an error saying what to pass, before anything reads them as a tree."""
    if (type(value).__module__ or "").startswith("orbax."):
        raise TypeError(
            f"CheckpointManager.{call} got Orbax's {type(value).__name__}: snapshard's manager "
            "takes the tree itself (save(step, state), restore(step, target)); to keep "
            "Orbax's CheckpointManager, give it snapshard.orbax.Handler (docs/integrations.md)"
        )


class StepWriter(StepListing):
    """The saving part of a CheckpointManager (manager.py; see the module docstring)."""

    def __init__(
        self,
        directory: Location | CheckpointRoot,
        coordinator: Coordinator | None,
        framework: Framework,
        policies: ManagerPolicies,
        *,
        save_interval_steps: int,
        max_to_keep: int | None,
        read_only: bool,
        async_save: bool,
        incremental: bool,
        save_options: SaveOptions,
        local_tier: LocalTier | None,
    ):
        """What the manager's arguments (see CheckpointManager) make of it, but its restores'
        and preemption's; and what it tracks: the save in flight and its error, reports,
        the lease, and for incremental saves the arrays last saved."""
        self._read_only = read_only
        self._lease_policy = policies.lease
        self._owner = f"the CheckpointManager created at {_created_at()} (id {id(self):#x})"
        self._save_policy = policies.save_policy(save_interval_steps)
        self._retention = policies.retention_of(max_to_keep)
        self._framework = framework
        root, best = root_for(directory), policies.best()
        super().__init__(root, coordinator or framework.coordinator(), save_options.timeout_s, best)
        if framework.warm_up is not None:  # once the arguments are known to be good
            framework.warm_up()
        self._save_options = save_options
        self._async = async_save
        if async_save and not read_only and background_of(save_options) == "process":
            start_writer_soon()  # its first save then finds the writer's interpreter started
        self._incremental = incremental
        self._inflight: tuple[int, BackgroundTask[None]] | None = None
        self._error: BaseException | None = None
        self._timings: dict[int, SaveTimings] = {}
        self._tier_reports: dict[int, TierReport] = {}
        self._pools = SavePools()  # the host buffers of this manager's saves (saving/staging.py)
        self._lease: WriterLease | None = None  # held by process 0 of a writer
        self._writing = False  # every process: the writer's start-up has run
        self._references = References(self._root)  # (references.py)
        self._saved_arrays: tuple[int, dict[Any, Any]] | None = None
        # An incremental save refers to the newest step only after a save committed: a
        # save that failed may have failed for its base (deleted by hand, or a step it
        # refers to), so the next one writes whole, alike on every process
        self._base_ok = True
        self._local = self._local_store(local_tier)

    def _local_store(self, tier: LocalTier | None) -> Any:
        if not tier:
            return None
        LocalStore = tier_of(self._framework).LocalStore  # the tier works on jax.Arrays (JAX only)

        store = LocalStore(tier, self._coord.process_index, self._coord.process_count)
        store.retain(store.tier.max_to_keep)
        return store

    def _become_writer(self) -> dict[int, StepInfo]:
        """Process 0 takes the writer lease and removes what crashed saves left; every
        process then holds the steps as the writer sees them (one rendezvous, so that the
        others learn of a refusal too)."""
        try:
            steps = self._agreed_steps(
                "manager-writer", "writer start of the checkpoint manager", self._take_lease,
                self._drop_unneeded_retained,
            )  # fmt: skip
        except BaseException:
            if self._lease is not None:  # the lease was taken, a later part failed
                self._lease.release()
                self._lease = None
            raise
        self._writing = True
        return steps

    def _take_lease(self) -> None:
        """Process 0: the directory's writer lease, then the clean-up of incomplete steps
        (a writer's act: with no lease, a live writer's staging area could be one)."""
        policy = self._lease_policy
        files = self._root.lease_files()
        lease = WriterLease(files, timeout_s=policy.timeout_s, owner=self._owner)
        lease.acquire(takeover=policy.takeover)
        self._lease = lease
        for name, committed in self._root.list().items():
            if not committed:
                log.info("removing incomplete checkpoint %s/%s", self._root.url, name)
                self._root.remove_incomplete(name)

    def _drop_unneeded_retained(self, steps: dict[int, StepInfo], retained: set[str]) -> None:
        """Process 0, as it becomes the writer: the steps retained for references that no
        committed step needs any more (their referrers deleted by hand) are removed, and
        `retained` with them; such a step would keep its number from a new save."""
        if retained:
            self._references.remove([], [str(s) for s in steps], retained)

    def should_save(self, step: int) -> bool:
        if self._read_only:
            return False
        with self._lock:
            if step in self._steps:
                return False
        return self._save_policy.should_save(step)

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
        """Save `step` if a save policy (or `force`) says so; returns whether it saved.

        The durable (persistent) tier saves when `should_save(step)`; the local tier, if
        configured, every `local_tier.interval` steps; `force` saves to both. Waits for a save
        still in flight first. Raises the error of an earlier background save, and
        CheckpointExistsError for a step that is already committed, ValueError for a step
        not newer than the newest saved one, and WriterLeaseError when this manager lost
        the directory's writer lease, or another writer holds it (taken at the first save
        that writes: see CheckpointManager's docstring)."""
        if self._read_only:
            raise ValueError(
                f"{self._root.url}: this CheckpointManager is read_only: it restores and lists, "
                "and saves nothing (make one without read_only=True to save)"
            )
        refuse_orbax_args(tree, "save")
        self._check_new_step(step)
        persistent = force or self._save_policy.should_save(step)
        local = self._local is not None and (force or self._local.tier.should_save(step))
        if not (persistent or local):
            return False
        if not self._writing:
            steps = self._become_writer()
            with self._lock:
                self._steps = steps
            self._check_unsaved(step)  # against the steps as the writer sees them
        t0 = time.perf_counter()
        info_metrics = dict(metrics) if metrics is not None else None
        try:
            flat = flatten(tree, self._framework.is_leaf)
        except Exception as e:
            if persistent:  # the other processes are in this step's save: they fail too
                with saves_counted_under(self._root.url):
                    failed_before(
                        self._root.child(str(step)), e, self._coord, self._save_options.timeout_s
                    )
            raise
        report = TierReport()
        local_work = None
        snapshot = None
        if local:
            assert self._local is not None
            stage_local = tier_of(self._framework).stage_local

            local_work, snapshot = stage_local(self._local, self._coord, step, flat, report)
        started, based = (
            self._start_persistent(step, tree, flat, snapshot, info_metrics)
            if persistent
            else (None, False)
        )
        report.blocking_s = time.perf_counter() - t0
        # What the blocking phase made (items, views, JAX's shard objects) stays out of the
        # collections while the save drains, as for save_async; its release runs the full
        # collection that may be due, here rather than in a blocking phase (gc_pause.py).
        frozen = Frozen()

        def work() -> None:
            try:
                if local_work is not None:
                    local_work()
                if started is not None:
                    timings = started.finish()
                    report.persistent_save_s = timings.total_s - timings.blocking_s
                    report.persistent_bytes = timings.bytes_written
                    if self._incremental and self._framework.immutable_arrays:
                        self._saved_arrays = (step, saved_arrays(flat))
                    self._after_commit(step, info_metrics, based)
            finally:
                frozen.release()

        task = BackgroundTask(work, f"save of step {step}")
        with self._lock:
            self._inflight = (step, task)
            _keep_newest(self._tier_reports, step, report)
            if started is not None:
                _keep_newest(self._timings, step, started.timings)
        if not self._async:
            self.wait_until_finished()
        return True

    def _check_new_step(self, step: int) -> None:
        """After the save in flight: raise its error, a lost lease, or a step that is not
        a new non-negative int newer than every saved one."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self.wait_until_finished()
        if self._lease is not None:
            self._lease.check()
        self._check_unsaved(step)

    def _check_unsaved(self, step: int) -> None:
        """Raise for a step that is committed already, or older than the newest one."""
        with self._lock:
            if step in self._steps:
                raise CheckpointExistsError(
                    f"step {step} already exists in {self._root.url}; it is never overwritten"
                )
            newest = max(self._steps, default=None)
            if newest is not None and step < newest:
                raise ValueError(
                    f"step {step} is older than the newest saved step {newest} of "
                    f"{self._root.url}; steps must increase (retention would delete it at once)"
                )

    def _start_persistent(
        self,
        step: int,
        tree: Any,
        flat: FlatTree,
        snapshot: Any,
        metrics: dict[str, Any] | None,
    ) -> tuple[StartedSave, bool]:
        """The blocking phase of the persistent tier's save of `step` (from the local tier's
        `snapshot` where it staged every byte already), staged into the manager's buffers;
        and whether it has a base (an incremental save's, which its chunks may refer to)."""
        options = self._save_options
        if snapshot is not None:
            options = replace(options, host_budget=None)
        incremental: dict[str, Any] = {}
        if self._incremental:
            options = replace(options, hashes=True)
            if self._base_ok:
                incremental = self._increment_from(flat)
            self._base_ok = False  # (until _after_commit)
        storage = self._root.child(str(step))
        if self._lease is not None:
            storage.commit_guard = self._lease.verify
        # (its saves named as the n-th under its directory: no count kept per step, blocking.py)
        with pools_for_saves(self._pools), saves_counted_under(self._root.url):
            started = self._framework.start_save(
                storage,
                tree,
                options,
                coordinator=self._coord,
                extra={"step": step, "metrics": metrics},
                snapshot=snapshot,
                flat=flat,
                **incremental,
            )
        return started, "base" in incremental

    def _after_commit(self, step: int, metrics: dict[str, Any] | None, based: bool) -> None:
        """Runs in the save's thread on every process: record the step, apply retention.
        `based`: the step's save had a base (see _start_persistent)."""
        if not based and self._coord.is_leader:  # retention need not read its manifest back
            self._references.saved_whole(str(step))
        self._base_ok = True
        with self._lock:
            self._steps[step] = StepInfo(step, metrics, time.time())
            doomed = self._retention.to_delete(self._steps.values())
            for s in doomed:
                del self._steps[s]
        if self._coord.is_leader and (doomed or self._retained):
            if self._lease is None:  # (a save made this manager the writer first)
                raise WriterLeaseError(f"{self._root.url}: the writer lease is not held")
            self._lease.verify()
            # Never a file a kept step refers to (steps of an incremental run, even when this
            # manager is not incremental): see references.py.
            with self._lock:
                kept = [str(s) for s in self._steps]
            self._references.remove([str(s) for s in doomed], kept, self._retained)

    def _increment_from(self, flat: FlatTree) -> dict[str, Any]:
        """prepare()'s arguments of an incremental save: the newest kept step as base, and the
        leaves that are the very jax.Arrays saved in it."""
        with self._lock:
            base = max(self._steps) if self._steps else None
        if base is None:
            return {}
        same = frozenset[int]()
        if self._saved_arrays is not None and self._saved_arrays[0] == base:
            # only set for frameworks with immutable arrays (JAX)
            same = identical_leaves(flat, self._saved_arrays[1])
        return {"base": self._root.child(str(base)), "identical": same}

    def wait_until_finished(self) -> None:
        """Wait for the save in flight; raise its error (or an earlier one) if any."""
        self._wait_inflight()
        self._raise_pending()


def _keep_newest(reports: dict[int, Any], step: int, report: Any) -> None:
    """Add the report of `step` (newer than every other), dropping the oldest beyond
    REPORTS_KEPT: a manager that saves a million steps holds no million reports."""
    reports[step] = report
    while len(reports) > REPORTS_KEPT:
        del reports[next(iter(reports))]


def _created_at() -> str:
    """`file:line` of the code that made the manager: the first frame outside snapshard,
    so that a message about two managers names the user's line, not the package's."""
    frame = user_frame()[0]
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
