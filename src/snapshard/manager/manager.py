"""CheckpointManager: numbered steps under one directory, with save and retention policies.

The manager is built in layers, each a module: the steps every process of the job holds
(listing.py), the saves, the writer lease and retention (writer.py), and here its making,
start-up, the saves' reports, restores, preemption and close. What depends on the arrays
(which values are leaves, the default coordinator, a save's blocking phase, load,
preemption) comes from a `Framework` (framework.py): JAX's by default, PyTorch's from
snapshard.torch.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any

from ..coordination import Coordinator
from ..coordination.preemption import PreemptionAgreement
from ..coordination.rendezvous import namespace
from ..errors import CheckpointNotFoundError
from ..frameworks import jax_wing
from ..options import ReadOptions, SaveOptions, require
from ..reading import ReadStats
from ..saving import SaveTimings
from ..storage import CheckpointRoot, Location
from .framework import Framework, tier_of
from .listing import steps_text
from .policies import ManagerPolicies, StepInfo, young_daly_interval
from .tier_config import LocalTier, RestoreReport, TierReport
from .writer import StepWriter, refuse_orbax_args

log = logging.getLogger("snapshard")
DEFAULT_POLICIES = ManagerPolicies()


class CheckpointManager(StepWriter):
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
        newest kept step for chunks that did not change (see references.py); a save after
        one that failed writes whole, since the failure may have been its base's (a step
        deleted by hand).
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
        super().__init__(
            directory,
            coordinator,
            framework,
            policies,
            save_interval_steps=save_interval_steps,
            max_to_keep=max_to_keep,
            read_only=read_only,
            async_save=async_save,
            incremental=incremental,
            save_options=save_options,
            local_tier=local_tier,
        )
        self._read_options = read_options
        self._preempted = threading.Event()
        # Every process names the key alike: the n-th manager on this directory in the job.
        self._preemption = (
            PreemptionAgreement(self._coord, namespace("preemption", self._root.url))
            if self._coord.process_count > 1
            else None
        )
        self.last_restore: RestoreReport | None = None
        self._old_sigterm: Any = None
        if policies.preemption.handle_sigterm:
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            self._steps = self._start()
        except BaseException:
            self._release()
            raise

    # ---- start-up --------------------------------------------------------------------
    def _start(self) -> dict[int, StepInfo]:
        """The job's token (which names its staging areas) is agreed here, not in the first
        save; then the steps, listed by process 0 (after taking the writer lease, with
        LeasePolicy.at_start)."""
        self._coord.job_token()
        if self._lease_policy.at_start:
            return self._become_writer()
        return self._agreed_steps("manager-start", "checkpoint manager start")

    def reload(self) -> None:
        """List the committed steps again. Every process calls it; process 0 lists and the
        others take its listing (one rendezvous). A manager that only restores (an
        evaluation job beside training) sees from then on the steps committed since it was
        made; a writer's own listing is current already."""
        self._wait_inflight()
        steps = self._agreed_steps("manager-scan", "listing of the checkpoint manager")
        with self._lock:
            self._steps = steps

    # ---- the saves' reports ----------------------------------------------------------
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
        refuse_orbax_args(target, "restore")
        if "args" in load_args:
            refuse_orbax_args(load_args["args"], "restore")
        if options is None:
            options = self._read_options
        require(options, ReadOptions)
        self._wait_inflight()
        # A reader: the step may have been committed since its listing, and (read_only,
        # beside a writer) the newest of its listing deleted by the writer's retention.
        stale = step is None and self._read_only
        if not self._writing and (stale or (step is not None and step not in self.all_steps())):
            self.reload()
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
                f"(its steps: {steps_text(self.all_steps())})"
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
