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

import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import Any

import jax

from ..adapters.leaves import SaveArray, is_save_leaf
from ..background import BackgroundTask
from ..coordination import Coordinator, default_coordinator
from ..coordination.jax_distributed import preemption_sync_point
from ..coordination.rendezvous import namespace
from ..coordination.transfer import PendingExchange, exchange, start_exchange
from ..errors import CheckpointExistsError, CheckpointNotFoundError, SnapshardError
from ..format.reading import read_manifest
from ..restore import ReadStats, is_target_leaf, load
from ..saving import DEFAULT_TIMEOUT_S, SaveTimings, classify_leaves, finish, prepare
from ..staging import Snapshot, host_snapshot
from ..storage import CheckpointRoot, Location, root_for
from ..tree import FlatTree, flatten, keypath_to_path, path_str
from .local_tier import (
    LocalStore,
    LocalTier,
    build_from_local,
    local_tree,
    pack_shards,
    peers,
    saved_fingerprints,
    shard_bytes,
    target_fingerprint,
    unpack_shards,
)
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
from .references import References, identical_leaves, is_retained, saved_arrays

log = logging.getLogger("snapshard")


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
        local_tier: LocalTier | None = None,
        incremental: bool = False,
    ):
        """`save_interval_steps`, `save_on_steps`: when `should_save` is true (or pass
        `save_policy`). Retention: keep the newest `max_to_keep` steps, or with `best_fn` the
        `max_to_keep` best by `best_fn(metrics)` (`best_mode` 'max'/'min'; steps without
        metrics are kept), plus every step divisible by `keep_period` (or pass `retention`).
        `handle_sigterm`: a SIGTERM makes `reached_preemption` true (single-process jobs;
        multi-process jobs use JAX's preemption service). `local_tier`: also keep each
        process's shards on node-local storage and on peers (see local_tier.py).
        `incremental`: every step records its chunks' content hashes and refers to the
        newest kept step for chunks that did not change (see references.py)."""
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
        self._inflight: tuple[int, BackgroundTask[None]] | None = None
        self._error: BaseException | None = None
        self._timings: dict[int, SaveTimings] = {}
        self._preempted = threading.Event()
        self._old_sigterm: Any = None
        if handle_sigterm:
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._tier_reports: dict[int, dict[str, float]] = {}
        self._holdings: list[dict[str, list[int]]] = []
        self.last_restore: dict[str, Any] = {}
        # incremental saves (references.py): steps retained for references, arrays last saved
        self._incremental = incremental
        self._references = References(self._root)
        self._retained: set[str] = set()
        self._saved_arrays: tuple[int, dict[Any, Any]] | None = None
        self._local = (
            LocalStore(local_tier, self._coord.process_index, self._coord.process_count)
            if local_tier
            else None
        )
        if self._local is not None:
            self._local.retain(self._local.tier.max_to_keep)
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
            self._coord.barrier(namespace("manager-start", self._root.url), self._timeout_s)

    def _scan(self) -> dict[int, StepInfo]:
        steps = {}
        for name, committed in self._root.list().items():
            if committed and name.isdigit():
                with self._root.child(name) as storage:
                    if is_retained(storage):
                        self._retained.add(name)
                        continue
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

    def tier_reports(self) -> dict[int, dict[str, float]]:
        """Per step: blocking time, local snapshot and peer-exchange time, local and persistent
        background time, and bytes this process wrote to each tier."""
        with self._lock:
            return {k: dict(v) for k, v in self._tier_reports.items()}

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
        """Save `step` if a save policy (or `force`) says so; returns whether it saved.

        The durable (persistent) tier saves when `should_save(step)`; the local tier, if
        configured, every `local_tier.interval` steps; `force` saves to both. Waits for a save
        still in flight first. Raises the error of an earlier background save, and
        CheckpointExistsError for a step that is already committed."""
        self._wait_inflight()
        self._raise_pending()
        with self._lock:
            if step in self._steps:
                raise CheckpointExistsError(
                    f"step {step} already exists in {self._root.url}; it is never overwritten"
                )
        persistent = force or self._save_policy.should_save(step)
        local = self._local is not None and (force or self._local.tier.should_save(step))
        if not (persistent or local):
            return False
        t0 = time.perf_counter()
        info_metrics = dict(metrics) if metrics is not None else None
        flat = flatten(tree, is_save_leaf)
        report: dict[str, float] = {}
        local_work = None
        snapshot = None
        if local:
            assert self._local is not None
            local_work, snapshot = self._stage_local(step, flat, report)
        prep = None
        incremental: dict[str, Any] = {}
        if persistent and self._incremental:
            incremental = self._increment_from(flat)
        if persistent:
            prep = prepare(
                self._root.child(str(step)),
                tree,
                mode=self._write_mode,
                timeout_s=self._timeout_s,
                coordinator=self._coord,
                copy_host_values=True,
                host_budget=None if snapshot is not None else self._host_budget,
                extra={"step": step, "metrics": info_metrics},
                snapshot=snapshot,
                flat=flat,
                **incremental,
            )
        report["blocking_s"] = time.perf_counter() - t0

        def work() -> None:
            if local_work is not None:
                local_work()
            if prep is not None:
                timings = finish(prep)
                report["persistent_save_s"] = timings.total_s - timings.blocking_s
                report["persistent_bytes"] = timings.bytes_written
                if self._incremental:
                    self._saved_arrays = (step, saved_arrays(flat))
                self._after_commit(step, info_metrics)

        task = BackgroundTask(work, f"save of step {step}")
        with self._lock:
            self._inflight = (step, task)
            self._tier_reports[step] = report
            if prep is not None:
                self._timings[step] = prep.timings
        if not self._async:
            self._wait_inflight()
            self._raise_pending()
        return True

    def _stage_local(
        self, step: int, flat: FlatTree, report: dict[str, float]
    ) -> tuple[Callable[[], None], Snapshot]:
        """Blocking part of a local-tier save: the host snapshot and the copies to peers.
        Returns the background part (writing own and peer copies) and the snapshot."""
        assert self._local is not None
        store = self._local
        me, n = self._coord.process_index, self._coord.process_count
        t0 = time.perf_counter()
        leaves = classify_leaves(flat, n)
        arrays = [(i, a) for i, a in enumerate(leaves) if isinstance(a, SaveArray)]
        snapshot = host_snapshot(arrays, me)
        own_tree = local_tree(leaves, flat, snapshot)
        t1 = time.perf_counter()
        # The copies to peers: dispatched now, in program order on every process (they are
        # collectives), and received by the background part.
        pending: dict[int, PendingExchange] = {}
        if n > 1:
            blob = pack_shards(leaves, snapshot, me)
            sizes = [shard_bytes(leaves, p) for p in range(n)]
            per_host = store.tier.processes_per_host
            for r in range(1, len(peers(0, n, store.tier.replicas, per_host)) + 1):
                k = r * per_host
                pending[(me - k) % n] = start_exchange(
                    blob, [(p, (p + k) % n) for p in range(n)], sizes
                )
        report["local_snapshot_s"] = t1 - t0
        report["peer_dispatch_s"] = time.perf_counter() - t1
        extra = {
            "tier": "local",
            "step": step,
            "process_count": n,
            "paths": [list(p) for p in flat.paths],
            "fingerprints": saved_fingerprints(flat),
        }

        def write() -> None:
            t = time.perf_counter()
            written = store.write(step, me, own_tree, extra)
            for src, exchange_in_flight in pending.items():
                t_wait = time.perf_counter()
                got = exchange_in_flight.result()
                report["peer_transfer_wait_s"] = time.perf_counter() - t_wait
                assert got is not None
                peer_tree = local_tree(leaves, flat, unpack_shards(leaves, got, src))
                written += store.write(step, src, peer_tree, extra)
            store.retain(store.tier.max_to_keep)
            report["local_save_s"] = time.perf_counter() - t
            report["local_bytes"] = written

        return write, snapshot

    def _after_commit(self, step: int, metrics: dict[str, Any] | None) -> None:
        """Runs in the save's thread on every process: record the step, apply retention."""
        with self._lock:
            self._steps[step] = StepInfo(step, metrics, time.time())
            doomed = self._retention.to_delete(self._steps.values())
            for s in doomed:
                del self._steps[s]
        if self._coord.is_leader and (doomed or self._retained):
            # Never a file a kept step refers to (steps of an incremental run, even when this
            # manager is not incremental): see references.py.
            with self._lock:
                kept = [str(s) for s in self._steps]
            self._references.remove([str(s) for s in doomed], kept, self._retained)

    def _increment_from(self, flat: FlatTree) -> dict[str, Any]:
        """prepare()'s options of an incremental save: the newest kept step as base, and the
        leaves that are the very jax.Arrays saved in it."""
        with self._lock:
            base = max(self._steps) if self._steps else None
        if base is None:
            return {"hashes": True}
        same = frozenset[int]()
        if self._saved_arrays is not None and self._saved_arrays[0] == base:
            same = identical_leaves(flat, self._saved_arrays[1])
        return {"base": self._root.child(str(base)), "hashes": True, "identical": same}

    def wait_until_finished(self) -> None:
        """Wait for the save in flight; raise its error (or an earlier one) if any."""
        self._wait_inflight()
        self._raise_pending()

    def restore(self, step: int | None = None, target: Any = None, **load_options: Any) -> Any:
        """Restore `step` (default: the newest restorable) with snapshard.load's semantics.

        With a local tier and a target, all processes first agree (one exchange of what each
        holds) on the newest step that the local tier and the peers' copies can restore
        completely onto this target's layout; if it is newer than the newest persistent step
        (or is the `step` asked for), each process restores from its own copy or a peer's.
        Otherwise the persistent tier serves the restore (any topology). Every process must
        call this with the same arguments. `last_restore` tells which tier served."""
        self._wait_inflight()
        t0 = time.perf_counter()
        if self._local is not None and target is not None:
            local_step = self._agree_on_local_step(step, target)
            if local_step is not None:
                out = self._restore_local(local_step, target)
                self.last_restore["seconds"] = time.perf_counter() - t0
                return out
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"no committed step in {self._root.url}")
        elif step not in self._steps:
            raise CheckpointNotFoundError(
                f"step {step} is not a committed step of {self._root.url}"
            )
        stats = load_options.pop("stats", None) or ReadStats()
        out = load(self._root.child(str(step)), target, stats=stats, **load_options)
        self.last_restore = {
            "tier": "persistent",
            "step": step,
            "bytes_read_persistent": stats.bytes_read,
            "bytes_read_local": 0,
            "bytes_from_peers": 0,
            "seconds": time.perf_counter() - t0,
        }
        return out

    def _agree_on_local_step(self, step: int | None, target: Any) -> int | None:
        """The step to restore from the local tier, the same on every process, or None."""
        assert self._local is not None
        flat, _ = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_target_leaf)
        fps = {path_str(keypath_to_path(kp)): target_fingerprint(t) for kp, t in flat}
        mine = self._local.holdings(fps)
        n = self._coord.process_count
        prefix = namespace("tier-restore", self._root.url)
        self._coord.set(f"{prefix}/{self._coord.process_index}", json.dumps(mine))
        held: list[dict[str, list[int]]] = [
            json.loads(self._coord.get(f"{prefix}/{q}", self._timeout_s)) for q in range(n)
        ]
        self._holdings = held
        complete = sorted(
            int(s)
            for s in set().union(*held)
            if set().union(*(h.get(s, []) for h in held)) >= set(range(n))
        )
        if step is not None:
            return step if step in complete else None
        newest_persistent = self.latest_step()
        if complete and (newest_persistent is None or complete[-1] > newest_persistent):
            return complete[-1]
        return None

    def _restore_local(self, step: int, target: Any) -> Any:
        """Every process rebuilds its shards from its own local copy, fetched from a peer
        first where its own is missing."""
        assert self._local is not None
        store, held = self._local, self._holdings
        me, n = self._coord.process_index, self._coord.process_count
        key = str(step)
        missing = [q for q in range(n) if q not in held[q].get(key, [])]
        pairs = [(min(h for h in range(n) if q in held[h].get(key, [])), q) for q in missing]
        received = 0
        while pairs:  # rounds in which each process sends at most once and receives at most once
            round_: list[tuple[int, int]] = []
            rest: list[tuple[int, int]] = []
            senders: set[int] = set()
            for src, dst in pairs:
                (rest if src in senders else round_).append((src, dst))
                senders.add(src)
            send = next((store.pack_files(step, dst) for src, dst in round_ if src == me), None)
            got = exchange(send, round_)
            if got is not None:
                store.unpack_files(step, got)
                received += got.nbytes
            pairs = rest
        entries, _, bytes_read = store.read_own(step)
        flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_target_leaf)
        leaves = []
        for kp, t in flat:
            name = path_str(keypath_to_path(kp))
            leaves.append(build_from_local(entries[name], t, name))
        self.last_restore = {
            "tier": "peer" if me in missing else "local",
            "step": step,
            "bytes_read_persistent": 0,
            "bytes_read_local": bytes_read,
            "bytes_from_peers": received,
        }
        return jax.tree_util.tree_unflatten(treedef, leaves)

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
