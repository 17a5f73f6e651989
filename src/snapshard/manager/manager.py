"""CheckpointManager: numbered steps under one directory, with save and retention policies.

Steps are checkpoints named by their number (`DIR/100`). Saves are asynchronous by default:
`save` returns once the owned slices are on the host; a save started while another is in
flight first waits for that one. After a commit the retention policies run and old steps are
deleted in the background by process 0 (never the newest committed step). Only a writer
changes the directory: at its first save (or when it is made, LeasePolicy.at_start) the
manager takes the directory's writer lease and removes what crashed saves left behind
(process 0, then one rendezvous); a manager that only restores and lists takes no lease and
works beside a live writer. Incomplete steps are never listed, and every process of a job
holds the listing process 0 made. A background failure is logged when it happens and raised,
naming the step, by the next `save`, `wait_until_finished` or `close` (once). The host
buffers its saves stage into are the manager's own, reused from one save to the next and
released by `close` (staging.py); it keeps the reports of its last `REPORTS_KEPT` saves, and
names its saves' rendezvous under its directory rather than each step's (saving/blocking.py),
so that nothing it or the process holds grows with the saves it makes. What depends on the
arrays (which values are leaves, the default coordinator, a save's blocking phase, load,
preemption) comes from a `Framework` (framework.py): JAX's by default, PyTorch's from
snapshard.torch.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import FrameType
from typing import Any

from ..background import BackgroundTask
from ..coordination import Coordinator
from ..coordination.preemption import PreemptionAgreement
from ..coordination.rendezvous import Rendezvous, namespace
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    SnapshardError,
    WriterLeaseError,
)
from ..format.reading import read_summary
from ..frameworks import jax_wing
from ..gc_pause import Frozen
from ..options import ReadOptions, SaveOptions, background_of, require
from ..reading import ReadStats
from ..saving import SaveTimings
from ..saving.blocking import saves_counted_under
from ..saving.writer_process import start_writer_soon
from ..staging import SavePools, pools_for_saves
from ..storage import CheckpointRoot, Location, root_for
from ..storage.lease import WriterLease
from ..tree import FlatTree, flatten, user_frame
from .framework import Framework, StartedSave, tier_of
from .policies import ManagerPolicies, StepInfo, young_daly_interval
from .references import References, identical_leaves, is_retained, saved_arrays
from .tier_config import LocalTier, RestoreReport, TierReport

log = logging.getLogger("snapshard")
DEFAULT_POLICIES = ManagerPolicies()
REPORTS_KEPT = 100  # save_timings() and tier_reports() of the newest this many saves


class BackgroundSaveError(SnapshardError):
    """A save that ran in the background failed."""

    def __init__(self, step: int, cause: BaseException):
        self.step = step
        super().__init__(
            f"the background save of step {step} failed: {type(cause).__name__}: {cause}"
        )


class CheckpointManager:
    """Numbered steps of one training run under one directory (see the module docstring).

    `should_save(step)` and `save(step, tree)` (asynchronous by default: it returns once the
    owned slices are on the host), `restore(step, target)`, `latest_step()` and
    `all_steps()`, `reload()`, `reached_preemption(step)`, `wait_until_finished()`,
    `close()` (or use it as a context manager). Every process of the job makes one and calls
    the same methods in the same order; a background failure is raised by the next call,
    never swallowed.

    Readers are not writers. Making a manager, listing its steps and restoring take no
    writer lease, so an evaluation job (or any job that only loads) works beside the
    training job that saves into the same directory. The lease is taken at the first save
    that writes, which is also when what crashed saves left is removed; that is what an
    Orbax or DCP user expects (neither locks a directory to read it). A training job that
    wants to learn of another writer before it trains passes
    `policies=ManagerPolicies(lease=LeasePolicy(at_start=True))`; `read_only=True` (Orbax's
    option of the same name) makes a manager that refuses to save. A reader's listing is
    the one made when it was made (or at its last `reload()`); `restore(step)` of a step
    not in it lists again first."""

    def __init__(
        self,
        directory: Location | CheckpointRoot,
        *,
        save_interval_steps: int = 1,
        max_to_keep: int | None = None,
        read_only: bool = False,
        async_save: bool = True,
        incremental: bool = False,
        save_options: SaveOptions = SaveOptions(),
        read_options: ReadOptions = ReadOptions(),
        local_tier: LocalTier | None = None,
        coordinator: Coordinator | None = None,
        policies: ManagerPolicies = DEFAULT_POLICIES,
        framework: Framework | None = None,
    ):
        """`save_interval_steps`: `should_save` is true every that many steps; `max_to_keep`:
        keep the newest that many steps (None: all); `read_only`: a manager that restores
        and lists only (an evaluation job): `save` raises, `should_save` is false, and it
        never takes the writer lease. `policies` (ManagerPolicies) gives any
        other save policy or retention in their place (the best steps by a metric, every
        k-th step forever, given steps), SIGTERM handling and the writer lease's timeout.
        `save_options`: how every step is written (snapshard.SaveOptions; its `timeout_s`
        also bounds the start-up rendezvous); `read_options`: how `restore` reads, unless
        it is given its own (its `timeout_s` also bounds the agreement on the tier).
        `local_tier`: also keep each process's shards on node-local storage and on peers
        (see local_tier.py).

        One writer per directory: process 0 takes the directory's writer lease at the first
        save (or when the manager starts, with LeasePolicy(at_start=True)) and gives it up in
        `close` (see storage/lease.py and LeasePolicy); a second writer on the directory
        fails there with WriterLeaseError naming the holder: another job by its host and
        pid, another manager of this process by where it was made.
        `incremental`: every step records its chunks' content hashes and refers to the
        newest kept step for chunks that did not change (see references.py).
        `framework`: whose arrays the trees hold (see framework.py); `snapshard.torch`'s
        CheckpointManager passes PyTorch's (None: JAX's)."""
        # None: JAX's (the face `snapshard.CheckpointManager` imports the JAX wing)
        framework = framework if framework is not None else jax_wing().framework()
        if local_tier is not None and not framework.local_tier:
            raise ValueError(f"the local tier is not available for {framework.name} state")
        require(save_options, SaveOptions, "save_options")
        require(read_options, ReadOptions, "read_options")
        require(policies, ManagerPolicies, "policies")
        if read_only and policies.lease.at_start:
            raise ValueError("a read_only manager takes no writer lease: not with at_start=True")
        self._read_only = read_only
        self._lease_policy = policies.lease
        self._owner = f"the CheckpointManager created at {_created_at()} (id {id(self):#x})"
        self._save_policy = policies.save_policy(save_interval_steps)
        self._retention = policies.retention_of(max_to_keep)
        self._best = policies.best()
        self._framework = framework
        self._root = root_for(directory)
        self._coord = coordinator or framework.coordinator()
        if framework.warm_up is not None:  # once the arguments are known to be good
            framework.warm_up()
        self._save_options = save_options
        self._read_options = read_options
        self._async = async_save
        if async_save and not read_only and background_of(save_options) == "process":
            start_writer_soon()  # its first save then finds the writer's interpreter started
        self._incremental = incremental
        self._init_state()
        self._local = self._local_store(local_tier)
        self._old_sigterm: Any = None
        if policies.preemption.handle_sigterm:
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._steps: dict[int, StepInfo] = self._start()
        except BaseException:
            self._release()
            raise

    def _init_state(self) -> None:
        """What the manager tracks: the save in flight and its error, reports, preemption,
        the lease, and for incremental saves the steps retained and the arrays last saved."""
        self._lock = threading.Lock()
        self._inflight: tuple[int, BackgroundTask[None]] | None = None
        self._error: BaseException | None = None
        self._timings: dict[int, SaveTimings] = {}
        self._preempted = threading.Event()
        # Every process names the key alike: the n-th manager on this directory in the job.
        self._preemption = (
            PreemptionAgreement(self._coord, namespace("preemption", self._root.url))
            if self._coord.process_count > 1
            else None
        )
        self._tier_reports: dict[int, TierReport] = {}
        self._pools = SavePools()  # the host buffers of this manager's saves (staging.py)
        self.last_restore: RestoreReport | None = None
        self._lease: WriterLease | None = None  # held by process 0 of a writer
        self._writing = False  # every process: the writer's start-up has run
        self._references = References(self._root)  # (references.py)
        self._retained: set[str] = set()
        self._saved_arrays: tuple[int, dict[Any, Any]] | None = None

    def _local_store(self, tier: LocalTier | None) -> Any:
        if not tier:
            return None
        LocalStore = tier_of(self._framework).LocalStore  # the tier works on jax.Arrays (JAX only)

        store = LocalStore(tier, self._coord.process_index, self._coord.process_count)
        store.retain(store.tier.max_to_keep)
        return store

    # ---- start-up --------------------------------------------------------------------
    def _start(self) -> dict[int, StepInfo]:
        """The job's token (which names its staging areas) is agreed here, not in the first
        save; then the steps, listed by process 0 (after taking the writer lease, with
        LeasePolicy.at_start)."""
        self._coord.job_token()
        if self._lease_policy.at_start:
            return self._become_writer()
        return self._agreed_steps("manager-start", "checkpoint manager start")

    def _become_writer(self) -> dict[int, StepInfo]:
        """Process 0 takes the writer lease and removes what crashed saves left; every
        process then holds the steps as the writer sees them (one rendezvous, so that the
        others learn of a refusal too)."""
        try:
            steps = self._agreed_steps(
                "manager-writer", "writer start of the checkpoint manager", self._take_lease
            )
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

    def _agreed_steps(
        self, kind: str, what: str, act: Callable[[], None] | None = None
    ) -> dict[int, StepInfo]:
        """The committed steps as process 0 lists them (after `act`, when given); the others
        take its listing with its outcome, so every process of a job holds the same steps
        even while another job commits and deletes, and learns of a failure. Sets the
        steps retained for references too."""
        rv = Rendezvous(
            self._coord,
            namespace(kind, self._root.url),
            f"{what} on {self._root.url}",
            self._save_options.timeout_s,
        )
        rv.start_clock()
        if not self._coord.is_leader:
            doc = rv.await_outcome()
            self._retained = set(doc["retained"])
            return {d["step"]: StepInfo(d["step"], d["metrics"], d["time"]) for d in doc["steps"]}
        try:
            if act is not None:
                act()
            steps, self._retained = self._scan()
        except BaseException as e:
            rv.publish_outcome(e)
            raise
        listing = [{"step": i.step, "metrics": i.metrics, "time": i.time} for i in steps.values()]
        rv.publish_outcome(steps=listing, retained=sorted(self._retained))
        return steps

    def _scan(self) -> tuple[dict[int, StepInfo], set[str]]:
        """The committed steps under the root, and the steps retained for references. A
        step deleted between the listing and the reading of its manifest (by a writer
        beside this reader) is not listed: a listing never shows a step being deleted or
        committed (both are one rename, or the commit marker, on the stores)."""
        steps, retained = {}, set()
        for name, committed in self._root.list().items():
            if not (committed and name.isdigit()):
                continue
            try:
                with self._root.child(name) as storage:
                    if is_retained(storage):
                        retained.add(name)
                        continue
                    summary = read_summary(storage)
            except CheckpointNotFoundError:
                continue  # deleted meanwhile
            metrics = summary.extra.get("metrics")
            steps[int(name)] = StepInfo(int(name), metrics, summary.created_unix)
        return steps, retained

    def reload(self) -> None:
        """List the committed steps again. Every process calls it; process 0 lists and the
        others take its listing (one rendezvous). A manager that only restores (an
        evaluation job beside training) sees from then on the steps committed since it was
        made; a writer's own listing is current already."""
        self._wait_inflight()
        steps = self._agreed_steps("manager-scan", "listing of the checkpoint manager")
        with self._lock:
            self._steps = steps

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
        """The best committed step by the retention's KeepBest, or None without one or metrics."""
        if self._best is None:
            return None
        with self._lock:
            ranked = self._best.rank(sorted(self._steps.values(), key=lambda s: s.step))
        return ranked[0].step if ranked else None

    def metrics(self, step: int) -> Mapping[str, Any] | None:
        with self._lock:
            return self._steps[step].metrics

    def should_save(self, step: int) -> bool:
        if self._read_only:
            return False
        with self._lock:
            if step in self._steps:
                return False
        return self._save_policy.should_save(step)

    def tier_reports(self) -> dict[int, TierReport]:
        """Per step: blocking time, local snapshot and peer-exchange time, local and persistent
        background time, and bytes this process wrote to each tier (the newest
        REPORTS_KEPT saves)."""
        with self._lock:
            return dict(self._tier_reports)

    def save_timings(self) -> dict[int, SaveTimings]:
        """Per-step blocking and background durations of the saves this manager made (the
        newest REPORTS_KEPT)."""
        with self._lock:
            return dict(self._timings)

    def recommended_save_interval(
        self, mtbf_s: float, *, step_time_s: float | None = None, cost: str = "blocking"
    ) -> float:
        """Young/Daly: τ = sqrt(2 · C · MTBF), C the mean measured cost of a save.

        cost='blocking' (default) takes the time the training step waits (the right C for
        asynchronous saves); 'total' the time to durable (for synchronous saves), over the
        newest REPORTS_KEPT saves. Returns seconds, or steps when `step_time_s` is given."""
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
        """True when the job is being preempted and this step should save
        (`save(step, tree, force=True)`) and exit. Call it on every process at every step.

        A single process: true once it saw SIGTERM (PreemptionPolicy(handle_sigterm=True)) or
        `notify_preemption()` was called. Several processes: where the framework's
        preemption sync service runs (JAX's, on by default with jax.distributed), its sync
        point decides, at one step on every process; the service catches SIGTERM on any
        process, so leave SIGTERM to it (no `handle_sigterm`, whose handler would replace the
        service's), and `notify_preemption()` there makes this process's answer true alone.
        Otherwise (torch.distributed; JAX with the service off) the processes agree through
        the coordinator (coordination/preemption.py): a process that saw the signal
        publishes the step it is at, and every process answers true at its first step past
        the first step published. That is the same step on every process when they run in
        step (a collective between one call and the next); a process that finds the
        published step only once it is already past it raises CoordinationError.
        Cost there: one lookup in the coordinator's store (the c10d store, or JAX's
        coordination service) per call on every process until a step is published, none
        after."""
        synced: bool | None = None
        sync_point = self._framework.preemption_sync_point
        if sync_point is not None:
            try:
                synced = sync_point(step)
            except RuntimeError:
                synced = None
        if synced:
            return True
        if synced is None and self._preemption is not None:
            return self._preemption.reached(step, self._preempted.is_set())
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
        """Save `step` if a save policy (or `force`) says so; returns whether it saved.

        The durable (persistent) tier saves when `should_save(step)`; the local tier, if
        configured, every `local_tier.interval` steps; `force` saves to both. Waits for a save
        still in flight first. Raises the error of an earlier background save, and
        CheckpointExistsError for a step that is already committed, ValueError for a step
        not newer than the newest saved one, and WriterLeaseError when this manager lost
        the directory's writer lease, or another writer holds it (taken at the first save
        that writes: see the class docstring)."""
        if self._read_only:
            raise ValueError(
                f"{self._root.url}: this CheckpointManager is read_only: it restores and lists, "
                "and saves nothing (make one without read_only=True to save)"
            )
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
        flat = flatten(tree, self._framework.is_leaf)
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
            incremental = self._increment_from(flat)
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

    def restore(
        self,
        step: int | None = None,
        target: Any = None,
        options: ReadOptions | None = None,
        *,
        stats: ReadStats | None = None,
        **load_args: Any,
    ) -> Any:
        """Restore `step` (default: the newest restorable) with snapshard.load's semantics
        (snapshard.torch.load's for torch state): `options` (default: the manager's
        `read_options`), `stats`, and the framework's own keywords in `load_args` (`mesh`,
        `resplit`; torch: `transform`).

        With a local tier and a target, all processes first agree (one exchange of what each
        holds) on the newest step that the local tier and the peers' copies can restore
        completely onto this target's layout; if it is newer than the newest persistent step
        (or is the `step` asked for), each process restores from its own copy or a peer's.
        Otherwise the persistent tier serves the restore (any topology). Every process must
        call this with the same arguments. `last_restore` tells which tier served and what
        it read. Of `options`, the local tier uses `timeout_s` alone (its copies are read
        whole, verified, from node-local files), and `stats` is filled by persistent
        restores only."""
        if options is None:
            options = self._read_options
        require(options, ReadOptions)
        self._wait_inflight()
        if step is not None and not self._writing and step not in self.all_steps():
            self.reload()  # a reader: the step may have been committed since its listing
        t0 = time.perf_counter()
        skipped: tuple[str, ...] = ()
        if self._local is not None and target is not None:
            out, report = self._restore_local(step, target, options)
            if report.tier:
                report.seconds = time.perf_counter() - t0
                self.last_restore = report
                return out
            skipped = report.skipped
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed step in {self._root.url}")
        elif step not in self.all_steps():
            raise CheckpointNotFoundError(
                f"step {step} is not a committed step of {self._root.url} "
                f"(its steps: {_steps_text(self.all_steps())})"
            )
        stats = stats if stats is not None else ReadStats()
        out = self._framework.load(
            self._root.child(str(step)), target, options, stats=stats, **load_args
        )
        self.last_restore = RestoreReport(
            tier="persistent",
            step=step,
            bytes_read_persistent=stats.bytes_read,
            bytes_from_peers=stats.bytes_from_peers,
            seconds=time.perf_counter() - t0,
            skipped=skipped,
        )
        return out

    def _restore_local(
        self, step: int | None, target: Any, options: ReadOptions
    ) -> tuple[Any, RestoreReport]:
        """The restore from the local tier and peers where the processes agree it can serve
        (`report.tier` says which served; empty: none), else an error for a `step` that the
        persistent tier does not hold either."""
        tier = tier_of(self._framework)
        TierRestore, restore_from_tiers = tier.TierRestore, tier.restore_from_tiers

        assert self._local is not None
        ask = TierRestore(
            namespace("tier-restore", self._root.url),
            target,
            step,
            self.latest_step(),
            options.timeout_s,
        )
        out, report = restore_from_tiers(self._local, self._coord, ask)
        if not report.tier and step is not None and step not in self._steps:
            failed = report.skipped
            raise CheckpointNotFoundError(
                f"step {step} is neither a committed step of {self._root.url} nor "
                "restorable from the local tier"
                + (f" (copies that failed verification: {'; '.join(failed)})" if failed else "")
            )
        return out, report

    def close(self) -> None:
        """Wait for the save in flight and raise any background error not raised yet; the
        host buffers of the manager's saves are released."""
        try:
            self.wait_until_finished()
        finally:
            self._release()

    def _release(self) -> None:
        """Give up the writer lease, restore the SIGTERM handler (each once) and release the
        saves' host buffers."""
        self._pools.close()
        if self._lease is not None:
            self._lease.release()
            self._lease = None
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


def _keep_newest(reports: dict[int, Any], step: int, report: Any) -> None:
    """Add the report of `step` (newer than every other), dropping the oldest beyond
    REPORTS_KEPT: a manager that saves a million steps holds no million reports."""
    reports[step] = report
    while len(reports) > REPORTS_KEPT:
        del reports[next(iter(reports))]


def _steps_text(steps: list[int]) -> str:
    """A listing of steps for a message: all of few, the ends of many."""
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))}"


def _created_at() -> str:
    """`file:line` of the code that made the manager: the first frame outside snapshard,
    so that a message about two managers names the user's line, not the package's."""
    frame = user_frame()[0]
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
