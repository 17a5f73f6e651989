"""The fast local tier: each process keeps its own shards on node-local storage, and copies of
its peers' shards, so that a restart restores without touching the durable tier.

On disk, under the tier's directory (one per host, e.g. /dev/shm/ckpt):

    process-00003/120/own          process 3's addressable shards at step 120
    process-00003/120/peer-00002   process 2's shards, copied to process 3

Each is an ordinary snapshard checkpoint (atomic, checksummed) of the tree
{"leaves": [entry, ...]}, one entry per leaf of the user's tree in flat order:
{"shards": {"a:b,c:d": array}} for a device array (its unique local boxes) and
{"value": x} for a host array or Python value. Its manifest's `extra` holds the leaf paths
and a fingerprint of every leaf's global layout, so a restore can tell whether the step
fits the target without reading data.

Peers: the copies of process p's shards go to processes (p + r·k) mod n for r = 1..replicas,
k the processes per host, so they sit on other hosts (a pure function of the layout, no
talking). The copy travels over JAX's collectives (ppermute.exchange).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..coordination import Coordinator, SingleProcessCoordinator
from ..dtypes import dtype_name
from ..errors import CorruptCheckpointError, SnapshardError, StorageError
from ..format.kinds import LeafKind
from ..format.leaves import ArrayLeaf, ValueLeaf
from ..manager.tier_config import LocalTier, RestoreReport, TierReport
from ..options import SaveOptions
from ..planning.layout import Box
from ..reading import ReadStats, aligned_empty
from ..restore import build_from_host, is_target_leaf
from ..save_leaves import SaveArray
from ..saving import classify_leaves, finish, prepare
from ..staging import Snapshot, host_snapshot
from ..storage import LocalRoot, LocalStorage
from ..storage.atomic_rename import move_into_place
from ..storage.stale_staging import STAGING_SUFFIX
from ..tree import FlatTree, keypath_to_path, path_str
from ..tree import Path as TreePath
from .arrays import layout_of
from .load import load
from .ppermute import PendingExchange, exchange, start_exchange

log = logging.getLogger("snapshard")

_SINGLE = SingleProcessCoordinator()
# A node-local copy is small and written beside training: one file, one thread.
_ONE_WRITER = SaveOptions(writers=1)


def peers(process: int, n: int, replicas: int, per_host: int) -> list[int]:
    """The processes holding copies of `process`'s shards, all on other hosts."""
    hosts = max(1, n // per_host)
    return [(process + r * per_host) % n for r in range(1, min(replicas, hosts - 1) + 1)]


def box_key(box: Box) -> str:
    return ",".join(f"{a}:{b}" for a, b in zip(*box, strict=True))


def fingerprint(kind: str, shape: tuple[int, ...], sharding: Any) -> str:
    """What must match between a saved leaf and a target leaf to restore it from this tier."""
    h = hashlib.sha256(f"{kind}{shape}".encode())
    if sharding is not None:
        lay = layout_of(tuple(shape), 1, sharding).layout
        for a in (lay.starts, lay.stops, lay.process_ids):
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:24]


def saved_fingerprints(flat: FlatTree) -> dict[str, str]:
    out = {}
    for path, v in zip(flat.paths, flat.leaves, strict=True):
        if isinstance(v, jax.Array):
            out[path_str(path)] = fingerprint("device", tuple(v.shape), v.sharding)
        elif isinstance(v, np.ndarray | np.generic):
            out[path_str(path)] = fingerprint("host", tuple(np.shape(v)), None)
        else:
            out[path_str(path)] = fingerprint("value", (), None)
    return out


def target_fingerprint(t: Any) -> str:
    if isinstance(t, jax.Array) or (
        isinstance(t, jax.ShapeDtypeStruct) and getattr(t, "sharding", None) is not None
    ):
        return fingerprint("device", tuple(t.shape), t.sharding)
    if isinstance(t, np.ndarray | np.generic | jax.ShapeDtypeStruct):
        return fingerprint("host", tuple(np.shape(t)), None)
    return fingerprint("value", (), None)


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


def local_tree(leaves: Sequence[Any], flat: FlatTree, snapshot: Snapshot) -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, SaveArray) and leaf.devices is not None:
            entry: dict[str, Any] = {"shards": {box_key(b): a for b, a in snapshot[i].items()}}
            if leaf.key_impl is not None:
                entry["key_impl"] = leaf.key_impl
            entries.append(entry)
        elif isinstance(leaf, ValueLeaf):
            entries.append({"value": leaf.value})
        else:  # a host array: the caller may change it once save returns
            entries.append({"value": np.array(flat.leaves[i], copy=True)})
    return {"leaves": entries}


class LocalStore:
    """This process's part of the local tier."""

    def __init__(self, tier: LocalTier, process: int, process_count: int):
        self.tier = tier
        self.process = process
        self.process_count = process_count
        self.root = Path(tier.directory) / f"process-{process:05d}"

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    def copy_name(self, owner: int) -> str:
        return "own" if owner == self.process else f"peer-{owner:05d}"

    def write(self, step: int, owner: int, tree: dict[str, Any], extra: dict[str, Any]) -> int:
        """Save `owner`'s local checkpoint of `step` here; returns the bytes written."""
        storage = LocalStorage(self.step_dir(step) / self.copy_name(owner))
        prep = prepare(
            storage,
            tree,
            _ONE_WRITER,
            overwrite=True,
            coordinator=_SINGLE,
            extra={**extra, "owner": owner},
        )
        return finish(prep).bytes_written

    def steps(self) -> list[int]:
        """Steps with a directory here (their copies may still be incomplete)."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())

    def holdings(self, target_fps: dict[str, str]) -> dict[int, list[int]]:
        """{step: processes whose complete data this process holds}, for the steps whose
        saved layout fits the target."""
        out: dict[int, list[int]] = {}
        for step in self.steps():
            for copy, ok in LocalRoot(self.step_dir(step)).list().items():
                if not ok or not (copy == "own" or copy.startswith("peer-")):
                    continue
                try:
                    extra = _read_extra(LocalStorage(self.step_dir(step) / copy))
                except SnapshardError as e:
                    log.warning("local tier: skipping %s: %s", self.step_dir(step) / copy, e)
                    continue
                if extra.get("process_count") != self.process_count:
                    continue
                saved = extra.get("fingerprints", {})
                if all(saved.get(p) == fp for p, fp in target_fps.items()):
                    out.setdefault(step, []).append(int(extra["owner"]))
        return {s: sorted(v) for s, v in out.items()}

    def retain(self, keep: int) -> None:
        """Keep the newest `keep` local steps of this process; remove the rest, and what
        unfinished saves left in the steps kept."""
        steps = self.steps()
        for s in steps[:-keep] if keep > 0 else steps:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)
        for s in steps[-keep:] if keep > 0 else []:
            copies = LocalRoot(self.step_dir(s))
            for name, ok in copies.list().items():
                if not ok:
                    copies.remove_incomplete(name)
        for p in self.root.iterdir() if self.root.is_dir() else ():
            if not p.name.isdigit():  # a step directory being created or removed
                shutil.rmtree(p, ignore_errors=True)

    def pack_files(self, step: int, owner: int) -> np.ndarray:
        """The files of a local checkpoint as one blob: header length, JSON header, contents."""
        d = self.step_dir(step) / self.copy_name(owner)
        names = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
        header = json.dumps([[n, os.path.getsize(d / n)] for n in names]).encode()
        blob = bytearray(struct.pack("<Q", len(header)) + header)
        for n in names:
            blob += (d / n).read_bytes()
        return np.frombuffer(bytes(blob), np.uint8)

    def unpack_files(self, step: int, blob: np.ndarray) -> None:
        """Write a blob from pack_files as this process's own copy of `step` (atomically)."""
        raw = blob.tobytes()
        (hlen,) = struct.unpack("<Q", raw[:8])
        files = json.loads(raw[8 : 8 + hlen])
        final = self.step_dir(step) / "own"
        tmp = final.with_name("own" + STAGING_SUFFIX)
        shutil.rmtree(tmp, ignore_errors=True)
        at = 8 + hlen
        for name, size in files:
            if ".." in Path(name).parts or Path(name).is_absolute():
                raise ValueError(f"unsafe file name {name!r} in peer data")
            p = tmp / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(raw[at : at + size])
            at += size
        move_into_place(tmp, final, replace=True)

    def read_own(self, step: int) -> tuple[dict[str, Any], int]:
        """This process's own local checkpoint of `step`: entries by path string, bytes read."""
        storage = LocalStorage(self.step_dir(step) / "own")
        extra = _read_extra(storage)
        stats = ReadStats()
        data = load(storage, stats=stats)
        paths = [tuple(p) for p in extra["paths"]]
        return {
            path_str(p): e for p, e in zip(paths, data["leaves"], strict=True)
        }, stats.bytes_read


def _read_extra(storage: LocalStorage) -> dict[str, Any]:
    from ..format.reading import read_summary

    with storage:
        return read_summary(storage).extra


def parse_box_key(key: str) -> Box:
    """The inverse of box_key."""
    pairs = [tuple(int(x) for x in part.split(":")) for part in key.split(",")] if key else []
    return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)


def build_from_local(entry: dict[str, Any], target: Any, path: TreePath, where: str) -> Any:
    """A restore-target leaf built from this process's local entry of it, by the builder
    `load` uses (restore.build_from_host): the target's sharding, shape and dtype."""
    if "value" in entry:
        v = entry["value"]
        if not isinstance(v, np.ndarray | np.generic):
            return v  # a Python value
        a = np.asarray(v)
        kind = LeafKind.SCALAR if isinstance(v, np.generic) else LeafKind.ARRAY
        key_impl, shape = None, a.shape
        boxes = {((0,) * a.ndim, a.shape): a}
    else:
        boxes = {parse_box_key(k): a for k, a in entry["shards"].items()}
        a = next(iter(boxes.values()))
        key_impl = entry.get("key_impl")
        kind = LeafKind.PRNG_KEY if key_impl is not None else LeafKind.ARRAY
        # The saved layout is the target's (their fingerprints match); keys add the data axis.
        shape = (*target.shape, a.shape[-1]) if key_impl is not None else tuple(target.shape)
    saved = ArrayLeaf(path, kind, dtype_name(a.dtype), tuple(shape), key_impl=key_impl)
    return build_from_host(saved, target, boxes, where)


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
