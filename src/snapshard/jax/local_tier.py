"""The fast local tier: each process keeps its own shards on node-local storage, and copies of
its peers' shards, so that a restart restores without touching the durable tier. The copies
and the `LocalStore` that holds them are local_copies.py's; this is the protocol, whose
functions every process calls in the same order: `stage_local` (a save's blocking part,
returning its background part), and for a restore `restore_from_tiers` (`agree_on_step`, then
`restore_local`; on a copy that fails verification, again without it, then the persistent
tier).

Peers: the copies of process p's shards go to processes (p + r·k) mod n for r = 1..replicas,
k the processes per host, so they sit on other hosts (a pure function of the layout, no
talking). The copy travels over JAX's collectives (ppermute.exchange).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..coordination import Coordinator
from ..errors import CorruptCheckpointError, StorageError
from ..manager.tier_config import RestoreReport, TierReport
from ..planning.layout import Box
from ..reading import aligned_empty
from ..reading.restore import is_target_leaf
from ..saving import classify_leaves
from ..saving.save_array import SaveArray
from ..saving.staging import Snapshot, host_snapshot
from ..tree import FlatTree, keypath_to_path, path_str
from ..tree import Path as TreePath
from .local_copies import (
    LocalStore,
    build_from_local,
    local_tree,
    saved_fingerprints,
    target_fingerprint,
)
from .ppermute import PendingExchange, exchange, start_exchange

# The tier's interface to the manager (manager/framework.py, `Framework.local_tier`).
__all__ = ["LocalStore", "TierRestore", "restore_from_tiers", "stage_local"]
log = logging.getLogger("snapshard")


def peers(process: int, n: int, replicas: int, per_host: int) -> list[int]:
    """The processes holding copies of `process`'s shards, all on other hosts."""
    hosts = max(1, n // per_host)
    return [(process + r * per_host) % n for r in range(1, min(replicas, hosts - 1) + 1)]


def process_boxes(arr: SaveArray, process: int) -> list[Box]:
    """The unique boxes of a device array held by `process`, in a canonical order."""
    lay = arr.layout
    rows = np.flatnonzero(lay.process_ids == process)
    return sorted({(tuple(lay.starts[r].tolist()), tuple(lay.stops[r].tolist())) for r in rows})


def shard_bytes(leaves: Sequence[Any], process: int) -> int:
    """The size of pack_shards(..., process): every process can compute every other's."""
    return sum(
        math.prod(b - a for a, b in zip(*box, strict=True)) * leaf.dtype.itemsize
        for leaf in leaves
        if isinstance(leaf, SaveArray) and leaf.devices is not None
        for box in process_boxes(leaf, process)
    )


def pack_shards(leaves: Sequence[Any], snapshot: Snapshot, process: int) -> np.ndarray:
    """The bytes of every local shard of `process`, concatenated in canonical order."""
    parts = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, SaveArray) and leaf.devices is not None:
            for box in process_boxes(leaf, process):
                parts.append(np.ascontiguousarray(snapshot[i][box]).reshape(-1).view(np.uint8))
    # Aligned, so that handing its pieces to the device for the transfer copies nothing (CPU).
    out = aligned_empty(sum(p.nbytes for p in parts))
    if parts:
        np.concatenate(parts, out=out)
    return out


def unpack_shards(leaves: Sequence[Any], blob: np.ndarray, process: int) -> Snapshot:
    """The inverse of pack_shards, for the shards of `process` (views into `blob`)."""
    out: Snapshot = {}
    at = 0
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, SaveArray) and leaf.devices is not None:
            boxes = out.setdefault(i, {})
            for box in process_boxes(leaf, process):
                shape = tuple(b - a for a, b in zip(*box, strict=True))
                n = math.prod(shape) * leaf.dtype.itemsize
                boxes[box] = blob[at : at + n].view(leaf.dtype).reshape(shape)
                at += n
    if at != blob.nbytes:
        raise ValueError(f"peer data of process {process} has {blob.nbytes} bytes, its shards {at}")
    return out


def target_leaves(target: Any) -> tuple[list[tuple[TreePath, Any]], Any]:
    """The (path, leaf) pairs of a restore target, and its treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_target_leaf)
    return [(keypath_to_path(kp), t) for kp, t in flat], treedef


# ---- the protocol: save, agree on a step, restore -----------------------------------------


def stage_local(
    store: LocalStore, coord: Coordinator, step: int, flat: FlatTree, report: TierReport
) -> tuple[Callable[[], None], Snapshot]:
    """Blocking part of a local-tier save: the host snapshot and the copies to peers.
    Returns the background part (writing own and peer copies) and the snapshot."""
    me, n = coord.process_index, coord.process_count
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
    report.local_snapshot_s = t1 - t0
    report.peer_dispatch_s = time.perf_counter() - t1
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
            report.peer_transfer_wait_s = time.perf_counter() - t_wait
            assert got is not None
            peer_tree = local_tree(leaves, flat, unpack_shards(leaves, got, src))
            written += store.write(step, src, peer_tree, extra)
        store.retain(store.tier.max_to_keep)
        report.local_save_s = time.perf_counter() - t
        report.local_bytes = written

    return write, snapshot


def exchange_all(coord: Coordinator, prefix: str, mine: Any, timeout_s: float) -> list[Any]:
    """Every process's `mine`, in process order: one set, one barrier and one listing per
    process (O(P) keys in all), then the keys are deleted."""
    n, me = coord.process_count, coord.process_index
    if n == 1:
        return [mine]
    coord.set(f"{prefix}/{me}", json.dumps(mine))
    coord.barrier(f"{prefix}/all-set", timeout_s)
    got = coord.get_dir(prefix)
    out = [json.loads(got[str(q)]) for q in range(n)]
    coord.barrier(f"{prefix}/all-read", timeout_s)
    if me == 0:
        coord.delete(prefix)
    return out


@dataclass(frozen=True)
class TierRestore:
    """What a restore asks of the local tier: `target`'s leaves at `step`, or with step
    None the newest step every process can restore completely if it is newer than
    `newest_persistent`; the processes agree under keys below `prefix`, each wait bounded
    by `timeout_s`."""

    prefix: str
    target: Any
    step: int | None
    newest_persistent: int | None
    timeout_s: float


def agree_on_step(
    store: LocalStore, coord: Coordinator, ask: TierRestore, prefix: str
) -> tuple[int | None, list[dict[str, list[int]]]]:
    """The step to restore from the local tier, the same on every process (or None), and
    what every process holds (exchanged under `prefix`)."""
    step, newest_persistent = ask.step, ask.newest_persistent
    fps = {path_str(p): target_fingerprint(t) for p, t in target_leaves(ask.target)[0]}
    mine = {str(s): v for s, v in store.holdings(fps).items()}
    held: list[dict[str, list[int]]] = exchange_all(coord, prefix, mine, ask.timeout_s)
    n = coord.process_count
    complete = sorted(
        int(s)
        for s in set().union(*held)
        if set().union(*(h.get(s, []) for h in held)) >= set(range(n))
    )
    if step is not None:
        return (step if step in complete else None), held
    if complete and (newest_persistent is None or complete[-1] > newest_persistent):
        return complete[-1], held
    return None, held


def restore_local(
    store: LocalStore,
    coord: Coordinator,
    step: int,
    held: list[dict[str, list[int]]],
    target: Any,
) -> tuple[Any, RestoreReport]:
    """Every process rebuilds its shards from its own local copy, fetched from a peer
    first where its own is missing. Raises CorruptCheckpointError when this process's
    copy fails verification (the caller then tries the next copy)."""
    me, n = coord.process_index, coord.process_count
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
    entries, bytes_read = store.read_own(step)
    where = str(store.step_dir(step) / "own")
    wanted, treedef = target_leaves(target)
    leaves = []
    for path, t in wanted:
        name = path_str(path)
        if name not in entries:
            raise CorruptCheckpointError(f"{where}: the local copy has no leaf {name!r}")
        leaves.append(build_from_local(entries[name], t, path, where))
    report = RestoreReport(
        tier="peer" if me in missing else "local",
        step=step,
        bytes_read_local=bytes_read,
        bytes_from_peers=received,
    )
    return jax.tree_util.tree_unflatten(treedef, leaves), report


def restore_from_tiers(
    store: LocalStore, coord: Coordinator, ask: TierRestore
) -> tuple[Any, RestoreReport] | tuple[None, RestoreReport]:
    """Restore from the nearest complete copy: own, then a peer's. A copy that fails
    verification is logged, removed, and the processes agree again without it (at most
    three rounds); (None, report) means the persistent tier must serve."""
    skipped: list[str] = []
    for attempt in range(3):
        chosen, held = agree_on_step(store, coord, ask, f"{ask.prefix}/{attempt}/holdings")
        if chosen is None:
            break
        error: str | None = None
        try:
            out, report = restore_local(store, coord, chosen, held, ask.target)
        except (CorruptCheckpointError, StorageError, OSError, ValueError, KeyError) as e:
            out, report = None, RestoreReport()
            error = f"{type(e).__name__}: {e}"
            where = store.step_dir(chosen) / "own"
            log.warning(
                "local tier: the copy of step %d at %s failed verification (%s); "
                "removing it and trying the next copy",
                chosen,
                where,
                error,
            )
            shutil.rmtree(where, ignore_errors=True)
        errors = exchange_all(coord, f"{ask.prefix}/{attempt}/outcome", error, ask.timeout_s)
        failed = [f"process {q} step {chosen}: {e}" for q, e in enumerate(errors) if e]
        if not failed:
            report.skipped = tuple(skipped)
            return out, report
        skipped.extend(failed)
    if skipped:
        log.warning(
            "local tier: falling back to the persistent tier after %d failed copies", len(skipped)
        )
    return None, RestoreReport(skipped=tuple(skipped))
