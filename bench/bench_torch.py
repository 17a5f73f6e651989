"""snapshard.torch against torch.distributed.checkpoint (DCP), torch.save and safetensors,
side by side in one run.

The bench state (common.tree_spec: the peer bench's ~2 GiB at --scale 1) as a PyTorch state
dict of DTensors over R ranks (gloo, CPU), laid out as FSDP2 lays it out: weights and
embeddings Shard(0) (rows), biases replicated. Every save is durable: snapshard fsyncs its
files and directories; DCP's FileSystemWriter has sync_files=True, and the directory is
fsync'd here; torch.save and safetensors.torch.save_file write one file per rank (the rank's
local tensors), fsync'd with its directory. Times are the slowest rank's; each save writes a
fresh checkpoint; restores read files still in the page cache.

    python bench/bench_torch.py                            # 2 ranks, ~2 GiB, 3 rounds
    python bench/bench_torch.py --scale 0.125 --repeats 1  # a quick check

Phase 1, R ranks (--ranks, default 2): every round, first the saves, then the restores, each
list in this order in the first round and in an order drawn for the round (seeded by it, the
same on every rank) after, so that no library always runs right after the same one:
  memcpy of the local shards (the floor of an async save's blocking phase);
  raw write of the bytes each rank owns into one file per rank (os.write, then fsync):
    what a plain durable write of the same bytes costs on this disk (snapshard starts the
    writeback of its files while it writes them, so it may be faster);
  snapshard save (sync); snapshard save_async: blocking / rest;
  DCP save with 1 and 2 writer threads;
  DCP async_save with the thread and the process executor: blocking / rest (an executor
    that fails is reported with its error, not timed);
  torch.save and safetensors save_file of each rank's local tensors;
  restore onto the save layout: snapshard, DCP, torch.load, safetensors load_file;
  restore onto another layout of the same ranks (weights Shard(1), biases Shard(0)):
    snapshard, snapshard with verify=False (checksums are per block of a chunk, so a
    verified partial read reads whole blocks), snapshard with read_once=True (bands of
    whole rows read once, then exchanged), DCP.
Phase 2, W ranks (--reshard-ranks; default 1 when R > 1, else 2), in fresh processes:
  phase 1's snapshard and DCP checkpoints restored onto the new world size (1 rank: plain
  full tensors; more: Shard(0) weights, replicated biases).

Each phase first runs all its operations on three leaves, unrecorded. Every restore goes
into a zeroed target and is checked bit for bit against common.make_array (every leaf in
the first round, common.CHECK_LEAVES after), and counts the bytes it read from the data
files (snapshard: ReadStats.bytes_read; DCP: a FileSystemReader counting the bytes read
through its file views; torch.save and safetensors: the whole file) against the bytes the
target holds, both summed over the ranks.

A last pass, untimed, counts the torch.distributed collectives each rank calls inside one
save (async: through its completion) and one restore of each library: every collective of
torch.distributed / distributed_c10d is wrapped, and a collective that calls another (as
all_gather_object calls all_gather) counts once. snapshard's c10d store requests are counted
by a proxy of the default store under its coordinator. What DCP's process executor does in
its daemon process is not seen from here.

Disk: about five times the state at the peak. Prints markdown tables (times, collectives,
targets) and writes the results as JSON lines (--out, default bench/results/torch-<time>.jsonl).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import distributed_c10d as c10d
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.utils import _ReaderView
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

import common as bc
from snapshard import ReadOptions

warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))

# Every collective of torch.distributed (those missing from a torch version are skipped).
COLLECTIVES = (
    "barrier",
    "monitored_barrier",
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
DCP_INFO = re.compile(r"\[\d+\] \S+ \S+ - root - INFO - ")
SAVE_LAYOUT, COLS_LAYOUT, FULL_LAYOUT = "Shard(0)", "Shard(1)", "full"


# ---------------------------------------------------------------- the state and its layouts
def _placement(kind: str, layout: str) -> Placement | None:
    """A leaf's placement: the save layout (FSDP2's Shard(0), biases replicated), the
    reshard layout (Shard(1), biases Shard(0)), or None (a plain tensor, whole)."""
    if layout == SAVE_LAYOUT:
        return Shard(0) if kind == "w" else Replicate()
    if layout == COLS_LAYOUT:
        return Shard(1) if kind == "w" else Shard(0)
    return None


def _full(name: str, scale: float) -> torch.Tensor:
    a = bc.make_array(name, scale)
    if a.dtype.itemsize == 2:  # bfloat16
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _cut(full: torch.Tensor, placement: Placement | None, world: int, rank: int) -> torch.Tensor:
    """This rank's part of `full` (DTensor cuts a Shard as torch.chunk does)."""
    if isinstance(placement, Shard):
        return full.chunk(world, dim=placement.dim)[rank]
    return full


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _state(scale: float, mesh: DeviceMesh | None, layout: str, fill: bool) -> dict:
    """name -> DTensor of the layout on mesh (plain tensors when mesh is None) holding the
    bench values, or zeros (a restore target) when not fill."""
    world, rank = (1, 0) if mesh is None else (mesh.size(), mesh.get_local_rank())
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dt, kind) in bc.tree_spec(scale).items():
        placement = _placement(kind, layout)
        if fill:
            local = _cut(_full(name, scale), placement, world, rank)
            local = local.clone(memory_format=torch.contiguous_format)
        else:
            dtype = torch.bfloat16 if dt == "bfloat16" else torch.float32
            meta = torch.empty(shape, dtype=dtype, device="meta")
            local = torch.zeros(_cut(meta, placement, world, rank).shape, dtype=dtype)
        if mesh is None or placement is None:
            out[name] = local
        else:
            out[name] = DTensor.from_local(local, mesh, [placement], run_check=False)
    return out


def _nbytes(sd: dict) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in sd.values())


def _owned(t: torch.Tensor, world: int, rank: int) -> memoryview:
    """The bytes of `t` this rank owns: its shard, or its 1/world of a replicated leaf."""
    from snapshard.torch.dtypes import host_view

    b = memoryview(host_view(_local(t)).reshape(-1).view(np.uint8))
    if isinstance(t, DTensor) and isinstance(t.placements[0], Shard):
        return b
    n = len(b) // world
    return b[rank * n : (rank + 1) * n]


def _owned_bytes(sd: dict, world: int, rank: int) -> int:
    return sum(len(_owned(t, world, rank)) for t in sd.values())


def _matches(sd: dict, names: list[str], scale: float, layout: str, world: int, rank: int) -> bool:
    """The named leaves of sd hold the bench values of this rank's part, bit for bit."""
    from snapshard.torch.dtypes import host_view

    spec = bc.tree_spec(scale)
    ok = True
    for name in names:
        want = _cut(_full(name, scale), _placement(spec[name][2], layout), world, rank)
        ok &= host_view(_local(sd[name])).tobytes() == host_view(want.contiguous()).tobytes()
    return ok


# ---------------------------------------------------------------- counting
class _CountingView(_ReaderView):
    """DCP's view of one stored item in a data file, adding the bytes read to its reader."""

    def __init__(self, base: Any, offset: int, length: int, reader: CountingReader) -> None:
        self.reader = reader
        super().__init__(base, offset, length)

    def readinto(self, b: Any) -> int:
        n = super().readinto(b)
        self.reader.bytes_read += n or 0
        return n

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        self.reader.bytes_read += len(data)
        return data


class CountingReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, counting the bytes it reads from the data files (the
    .metadata file is not counted)."""

    bytes_read = 0

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        return _CountingView(file, sinfo.offset, sinfo.length, self)


class CountingStore:
    """A c10d store, forwarded, counting every request by method name."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
            return attr(*a, **k)

        return call


@contextlib.contextmanager
def counting_collectives() -> Iterator[Counter[str]]:
    """Count the torch.distributed collectives called inside the block, in any thread, by
    name; one that calls another (all_gather_object calls all_gather) counts once."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    depth = threading.local()
    saved: dict[str, tuple[Any, Any]] = {}

    def wrap(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*a: Any, **k: Any) -> Any:
            d = getattr(depth, "n", 0)
            if d == 0:
                with lock:
                    counts[name] += 1
            depth.n = d + 1
            try:
                return fn(*a, **k)
            finally:
                depth.n = d

        return inner

    for name in COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        saved[name] = (fn, getattr(dist, name, None))
        w = wrap(name, fn)
        setattr(c10d, name, w)
        if saved[name][1] is not None:
            setattr(dist, name, w)
    try:
        yield counts
    finally:
        for name, (fn, public) in saved.items():
            setattr(c10d, name, fn)
            if public is not None:
                setattr(dist, name, public)


# ---------------------------------------------------------------- one rank
class Recorder:
    """The measurements of one rank, gathered so that rank 0 holds every rank's."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.on = True  # False while warming up: nothing is recorded
        self.rows: dict[str, list[float]] = {}
        self.bytes: dict[str, list[int]] = {}  # [read, needed], summed over the ranks
        self.exact: dict[str, bool] = {}
        self.errors: dict[str, str] = {}
        self.counts: dict[str, list[dict[str, Any]]] = {}  # per rank

    def gather(self, x: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, x)
        return out

    def timed(self, name: str, fn: Callable[[], Any]) -> Any:
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        slowest = max(self.gather(dt))
        if self.on:
            self.rows.setdefault(name, []).append(slowest)
        return out

    def restore(
        self, name: str, fn: Callable[[dict], int], target: dict, layout: str, every_leaf: bool
    ) -> None:
        """Time fn(target) (which returns the bytes it read), then check the target."""
        for t in target.values():
            _local(t).zero_()
        read = self.timed(name, lambda: fn(target))
        names = [k for k in target if every_leaf or k in bc.CHECK_LEAVES]
        ok = _matches(target, names, self.scale, layout, self.world, self.rank)
        per_rank = self.gather((read, _nbytes(target), ok))
        if self.on:
            self.bytes[name] = [sum(r for r, _, _ in per_rank), sum(n for _, n, _ in per_rank)]
            self.exact[name] = self.exact.get(name, True) and all(o for _, _, o in per_rank)

    def counted(self, name: str, fn: Callable[[], Any], store: CountingStore | None = None) -> None:
        dist.barrier()
        before = Counter(store.counts) if store is not None else Counter()
        with counting_collectives() as calls:
            fn()
        requests = dict(store.counts - before) if store is not None else None
        self.counts[name] = self.gather({"collectives": dict(calls), "store": requests})

    def fresh(self, root: str, name: str) -> str:
        """A checkpoint path that does not exist, with the writeback of earlier steps done."""
        path = os.path.join(root, name)
        if self.rank == 0:
            bc.remove(path)
            os.makedirs(root, exist_ok=True)
            bc.settle()
        dist.barrier()
        return path

    def drop(self, path: str) -> None:
        dist.barrier()
        if self.rank == 0:
            bc.remove(path)

    def result(self, **kw: Any) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "bytes": self.bytes,
            "exact": self.exact,
            "errors": self.errors,
            "counts": self.counts,
            **kw,
        }


def _subset(sd: dict, names: tuple[str, ...]) -> dict:
    return {k: sd[k] for k in names}


def _dcp_save(sd: dict, path: str, threads: int = 1) -> None:
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))
    if dist.get_rank() == 0:
        bc.fsync_path(path)


def _dcp_load(sd: dict, path: str) -> int:
    reader = CountingReader(path)
    dcp.load(sd, storage_reader=reader)
    return reader.bytes_read


def _sst_load(sd: dict, path: str, verify: bool = True, read_once: bool | None = None) -> int:
    import snapshard.torch as sst
    from snapshard.reading import ReadStats

    stats = ReadStats()
    sst.load(path, sd, stats=stats, options=ReadOptions(verify=verify, read_once=read_once))
    return stats.bytes_read


def _dcp_async(sd: dict, path: str, group: Any, executor: AsyncCheckpointerType) -> Any:
    return dcp.async_save(
        sd,
        storage_writer=dcp.FileSystemWriter(path),
        process_group=group,
        async_checkpointer_type=executor,
    )


def _guarded(err: list[str], fn: Callable[..., Any], *a: Any) -> Any:
    """fn(*a), or None with its error added to err; nothing runs once err holds one."""
    if err:
        return None
    try:
        return fn(*a)
    except Exception as e:
        err.append(f"{type(e).__name__}: {e}"[:300])
        return None


def _async_done(fut: Any, path: str) -> None:
    """Wait for a DCP async_save (a Future, or an AsyncSaveResponse); fsync its directory."""
    getattr(fut, "upload_completion", fut).result()
    if dist.get_rank() == 0:
        bc.fsync_path(path)


def _phase_save(args: argparse.Namespace, mesh: DeviceMesh, rec: Recorder) -> dict[str, Any]:
    import snapshard.torch as sst
    from snapshard.torch.dtypes import host_view

    st: Any
    try:
        import safetensors.torch as st
    except ImportError:
        st = None
    world, rank = rec.world, rec.rank
    root = bc.ckpt_dir("torch")
    state = _state(args.scale, mesh, SAVE_LAYOUT, fill=True)
    targets = {lay: _state(args.scale, mesh, lay, fill=False) for lay in (SAVE_LAYOUT, COLS_LAYOUT)}
    async_group = dist.new_group(backend="gloo")  # DCP's async save talks in its own thread
    bufs = {k: np.empty(_nbytes({k: v}), np.uint8) for k, v in state.items()}
    executors = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}
    if st is None and rank == 0:
        print("safetensors is not installed: its rows are skipped", file=sys.stderr)

    def memcpy(sd: dict) -> None:
        for k, v in sd.items():
            np.copyto(bufs[k], host_view(_local(v)).reshape(-1).view(np.uint8))

    def local_save(sd: dict, path: str, fmt: str) -> None:
        os.makedirs(path, exist_ok=True)
        f = os.path.join(path, f"rank{rank}.{fmt}")
        tensors = {k: _local(v) for k, v in sd.items()}
        if fmt == "pt":
            torch.save(tensors, f)
        else:
            st.save_file(tensors, f)
        bc.fsync_path(f)
        bc.fsync_path(path)

    def local_load(sd: dict, path: str, fmt: str) -> int:
        f = os.path.join(path, f"rank{rank}.{fmt}")
        got = torch.load(f, weights_only=True) if fmt == "pt" else st.load_file(f)
        for k, v in sd.items():
            _local(v).copy_(got[k])
        return os.path.getsize(f)

    def raw_write(sd: dict, path: str) -> None:
        """A plain durable write: the bytes this rank owns (its shards, its 1/world of each
        replicated leaf) written with os.write into one file, fsync'd with its directory."""
        bc.write_durable(path, f"rank{rank}.bin", (_owned(t, world, rank) for t in sd.values()))

    def shuffled(ops: list[Callable[[], None]], r: int) -> None:
        """Run `ops` as listed in round 0 (the tables keep that order), then in an order
        drawn for round r, the same on every rank: no library always runs right after the
        same one."""
        order = list(ops)
        if r:
            random.Random(r).shuffle(order)
        for op in order:
            op()

    def timed_save(name: str, path: str, fn: Callable[[str], Any], keep: bool = False) -> None:
        p = rec.fresh(root, path)
        rec.timed(name, lambda: fn(p))
        if not keep:
            rec.drop(p)

    def snapshard_async(sd: dict) -> None:
        p = rec.fresh(root, "sst-async")
        job = rec.timed("snapshard save_async: blocking", lambda: sst.save_async(p, sd))
        rec.timed("snapshard save_async: rest", job.wait)
        rec.drop(p)

    def dcp_async(sd: dict, kind: str, executor: AsyncCheckpointerType) -> None:
        label = f"DCP async_save ({kind})"
        if label in rec.errors:
            return
        p = rec.fresh(root, f"dcp-async-{kind}")
        err: list[str] = []  # reported, not raised: the process executor is young
        fut = rec.timed(
            f"{label}: blocking",
            lambda: _guarded(err, _dcp_async, sd, p, async_group, executor),
        )
        rec.timed(f"{label}: rest", lambda: _guarded(err, _async_done, fut, p))
        failed = [m for m in rec.gather(err[0] if err else None) if m]
        if failed:
            rec.errors[label] = failed[0]
            for part in ("blocking", "rest"):
                rec.rows.pop(f"{label}: {part}", None)
        rec.drop(p)

    fmts = {"pt": ("torch.save", "torch.load")}
    if st is not None:
        fmts["safetensors"] = ("safetensors save_file", "safetensors load_file")
    sst_p, dcp_p = os.path.join(root, "sst-sync"), os.path.join(root, "dcp-t1")

    def one_round(sd: dict, tg: dict[str, dict], every_leaf: bool, r: int) -> None:
        saves: list[Callable[[], None]] = [
            lambda: rec.timed("memcpy of the local shards", lambda: memcpy(sd)),
            lambda: timed_save(
                "raw write of the owned bytes, one file per rank", "raw", lambda p: raw_write(sd, p)
            ),
            lambda: timed_save(  # kept: the restores read it
                "snapshard save (sync)", "sst-sync", lambda p: sst.save(p, sd), keep=True
            ),
            lambda: snapshard_async(sd),
            *[
                lambda n=n: timed_save(  # dcp-t1 kept for the restores
                    f"DCP save, {n} thread(s)", f"dcp-t{n}", lambda p: _dcp_save(sd, p, n), n == 1
                )
                for n in (1, 2)
            ],
            *[lambda k=k, ex=ex: dcp_async(sd, k, ex) for k, ex in executors.items()],
            *[
                lambda f=f, saver=saver: timed_save(  # kept for the restores
                    f"{saver}, one file per rank",
                    f"local-{f}",
                    lambda p: local_save(sd, p, f),
                    keep=True,
                )
                for f, (saver, _) in fmts.items()
            ],
        ]
        shuffled(saves, r)

        def restore(name: str, fn: Callable[[dict], int], layout: str) -> Callable[[], None]:
            return lambda: rec.restore(name, fn, tg[layout], layout, every_leaf)

        same, cols = SAVE_LAYOUT, COLS_LAYOUT
        restores = [
            restore(f"snapshard load, {same}", lambda t: _sst_load(t, sst_p), same),
            restore(f"DCP load, {same}", lambda t: _dcp_load(t, dcp_p), same),
            *[
                restore(
                    f"{loader} + copy, {same}",
                    lambda t, f=f: local_load(t, os.path.join(root, f"local-{f}"), f),
                    same,
                )
                for f, (_, loader) in fmts.items()
            ],
            restore(f"snapshard load, reshard to {cols}", lambda t: _sst_load(t, sst_p), cols),
            restore(
                f"snapshard load, reshard to {cols}, verify=False",
                lambda t: _sst_load(t, sst_p, verify=False),
                cols,
            ),
            restore(
                f"snapshard load, reshard to {cols}, read_once=True",
                lambda t: _sst_load(t, sst_p, read_once=True),
                cols,
            ),
            restore(f"DCP load, reshard to {cols}", lambda t: _dcp_load(t, dcp_p), cols),
        ]
        shuffled(restores, r)
        for f in fmts:
            rec.drop(os.path.join(root, f"local-{f}"))

    rec.on = False
    warm = bc.WARMUP_LEAVES
    one_round(_subset(state, warm), {k: _subset(v, warm) for k, v in targets.items()}, True, 0)
    rec.on = True
    for r in range(args.repeats):
        one_round(state, targets, every_leaf=r == 0, r=r)

    # Collectives and store requests of one save and one restore, untimed.
    store = CountingStore(c10d._get_default_store())
    coord = sst.TorchStoreCoordinator(store)
    p = rec.fresh(root, "count-sst")
    rec.counted("snapshard save (sync)", lambda: sst.save(p, state, coordinator=coord), store)
    rec.drop(p)
    p = rec.fresh(root, "count-sst")
    rec.counted(
        "snapshard save_async, through wait()",
        lambda: sst.save_async(p, state, coordinator=coord).wait(),
        store,
    )
    rec.drop(p)
    p = rec.fresh(root, "count-dcp")
    rec.counted("DCP save (sync)", lambda: _dcp_save(state, p))
    rec.drop(p)
    for kind, executor in executors.items():
        label = f"DCP async_save ({kind})"
        if label in rec.errors:
            continue
        p = rec.fresh(root, "count-dcp")
        unseen = " (its daemon's collectives not seen)" if kind == "process" else ""
        rec.counted(
            f"{label}, through its future{unseen}",
            lambda p=p, ex=executor: _async_done(_dcp_async(state, p, async_group, ex), p),
        )
        rec.drop(p)
    for lay in (SAVE_LAYOUT, COLS_LAYOUT):
        t = targets[lay]
        rec.counted(f"snapshard load, {lay}", lambda t=t: _sst_load(t, sst_p))
        rec.counted(f"DCP load, {lay}", lambda t=t: _dcp_load(t, dcp_p))
    return {
        "owned_bytes_per_rank": _owned_bytes(state, world, rank),
        "local_bytes_per_rank": _nbytes(state),
        "payload": bc.payload_bytes(args.scale),
    }


def _phase_reshard(args: argparse.Namespace, mesh: DeviceMesh, rec: Recorder) -> dict[str, Any]:
    """Restore phase 1's checkpoints (saved by args.saved_ranks) onto this world size."""
    root = bc.ckpt_dir("torch")
    world = rec.world
    layout = FULL_LAYOUT if world == 1 else SAVE_LAYOUT
    target = _state(args.scale, None if world == 1 else mesh, layout, fill=False)
    what = "plain tensors" if world == 1 else layout
    sst_p, dcp_p = os.path.join(root, "sst-sync"), os.path.join(root, "dcp-t1")
    sst_name = f"snapshard load, {args.saved_ranks} -> {world} rank(s), {what}"
    dcp_name = f"DCP load, {args.saved_ranks} -> {world} rank(s), {what}"

    def one_round(tg: dict, every_leaf: bool) -> None:
        rec.restore(sst_name, lambda t: _sst_load(t, sst_p), tg, layout, every_leaf)
        rec.restore(dcp_name, lambda t: _dcp_load(t, dcp_p), tg, layout, every_leaf)

    rec.on = False
    one_round(_subset(target, bc.WARMUP_LEAVES), True)
    rec.on = True
    for r in range(args.repeats):
        one_round(target, every_leaf=r == 0)
    rec.counted(sst_name, lambda: _sst_load(target, sst_p))
    rec.counted(dcp_name, lambda: _dcp_load(target, dcp_p))
    return {"sst_name": sst_name, "dcp_name": dcp_name}


def rank_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where DCP's process executor listens
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.ranks,
        timeout=timedelta(seconds=900),
    )
    mesh = init_device_mesh("cpu", (args.ranks,))
    rec = Recorder(args.scale)
    phase = _phase_save if args.phase == "save" else _phase_reshard
    extra = phase(args, mesh, rec)
    extra["peak_rss_per_rank"] = rec.gather(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    if rec.rank == 0:
        bc.emit(**rec.result(**extra))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the driver
def _spawn(args: argparse.Namespace, ranks: int, phase: str) -> dict[str, Any]:
    """Run one phase on `ranks` fresh processes; their stderr is shown once they exit, less
    the INFO lines DCP's async-save daemon logs for every request."""
    port = bc.free_port()
    # As torchrun sets them: snapshard shares the CPUs among the LOCAL_WORLD_SIZE ranks.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(ranks)}
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--port", str(port)]
    cmd += ["--ranks", str(ranks), "--saved-ranks", str(args.ranks)]
    cmd += ["--scale", str(args.scale), "--repeats", str(args.repeats)]
    with contextlib.ExitStack() as stack:
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(ranks)]
        procs = [
            subprocess.Popen(
                [*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=errs[r], env=env, text=True
            )
            for r in range(ranks)
        ]
        outs = [p.communicate()[0] for p in procs]
        for f in errs:
            f.seek(0)
            sys.stderr.writelines(line for line in f if not DCP_INFO.match(line))
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    codes = [p.returncode for p in procs]
    raise SystemExit(f"phase {phase!r} on {ranks} rank(s) gave no result (exit codes {codes})")


def _paired(a: list[float] | None, b: list[float] | None) -> list[float]:
    """a[i] / b[i] for the rounds both have."""
    return [x / y for x, y in zip(a or [], b or [], strict=False) if y]


def _total(per_rank: dict[str, int]) -> int:
    return sum(per_rank.values())


def _report(args: argparse.Namespace, ranks2: int, res1: dict, res2: dict) -> None:
    rows = {**res1["rows"], **res2["rows"]}
    nbytes = {**res1["bytes"], **res2["bytes"]}
    exact = {**res1["exact"], **res2["exact"]}
    counts = {**res1["counts"], **res2["counts"]}
    errors = {**res1["errors"], **res2["errors"]}
    mib = 2**20
    print(
        f"\n{args.ranks} ranks, then {ranks2}; {res1['payload'] / mib:.0f} MiB state, "
        f"{res1['owned_bytes_per_rank'] / mib:.0f} MiB owned and "
        f"{res1['local_bytes_per_rank'] / mib:.0f} MiB held per rank; {args.repeats} round(s); "
        "peak RSS per rank "
        + ", ".join(f"{b / mib:.0f}" for b in res1["peak_rss_per_rank"])
        + " MiB, then "
        + ", ".join(f"{b / mib:.0f}" for b in res2["peak_rss_per_rank"])
        + " MiB\n"
    )
    print("## Times (seconds, slowest rank; median [min-max] over the rounds)\n")
    print("| operation | s | read / needed (all ranks) | bit-exact |")
    print("|---|---|---|---|")
    for name, v in rows.items():
        rb = ""
        if name in nbytes:
            read, needed = nbytes[name]
            rb = f"{read / needed:.3f} ({read / mib:.0f} / {needed / mib:.0f} MiB)"
        ok = "" if name not in exact else ("yes" if exact[name] else "NO")
        print(f"| {name} | {bc.spread(v, 3)} | {rb} | {ok} |")
    for name, err in errors.items():
        print(f"| {name} | failed: {err} | | |")

    print("\n## Collectives per call (untimed pass; per rank, separated by /)\n")
    print("| operation | collective calls | barriers | store requests | calls on rank 0 |")
    print("|---|---|---|---|---|")
    for name, per_rank in counts.items():
        coll = " / ".join(str(_total(c["collectives"])) for c in per_rank)
        bar = " / ".join(str(c["collectives"].get("barrier", 0)) for c in per_rank)
        store = " / ".join("-" if c["store"] is None else str(_total(c["store"])) for c in per_rank)
        detail = ", ".join(f"{k} {n}" for k, n in sorted(per_rank[0]["collectives"].items()))
        print(f"| {name} | {coll} | {bar} | {store} | {detail or '-'} |")

    dcp_sync = {n: rows[f"DCP save, {n} thread(s)"] for n in (1, 2)}
    best_n = min(dcp_sync, key=lambda n: statistics.median(dcp_sync[n]))
    blocking = rows.get("snapshard save_async: blocking")
    raw = rows.get("raw write of the owned bytes, one file per rank")
    checks = [
        (
            f"durable save: DCP sync (best: {best_n} thread(s)) / snapshard sync",
            _paired(dcp_sync[best_n], rows.get("snapshard save (sync)")),
            ">= 1.8",
        ),
        (  # how far DCP is from a plain write of the same bytes
            f"durable save: DCP sync (best: {best_n} thread(s)) / raw write",
            _paired(dcp_sync[best_n], raw),
            "",
        ),
        (
            "durable save: raw write / snapshard sync",
            _paired(raw, rows.get("snapshard save (sync)")),
            ">= 0.9",
        ),
        (
            "async blocking: snapshard / memcpy of the local shards",
            _paired(blocking, rows.get("memcpy of the local shards")),
            "<= 1.2",
        ),
    ]
    for kind in ("thread", "process"):
        checks.append(
            (
                f"async blocking: snapshard / DCP async_save ({kind})",
                _paired(blocking, rows.get(f"DCP async_save ({kind}): blocking")),
                "<= 0.3",
            )
        )
    restores = [
        (f"restore {SAVE_LAYOUT} -> {SAVE_LAYOUT}", f"load, {SAVE_LAYOUT}"),
        (f"restore {SAVE_LAYOUT} -> {COLS_LAYOUT}", f"load, reshard to {COLS_LAYOUT}"),
        (f"restore {args.ranks} -> {ranks2} rank(s)", res2["sst_name"][len("snapshard ") :]),
    ]
    once = ", read_once=True"
    for label, suffix in [*restores, (restores[1][0] + once, restores[1][1] + once)]:
        dcp_suffix = suffix.removesuffix(once)
        checks.append(
            (
                f"{label}: DCP / snapshard",
                _paired(rows.get(f"DCP {dcp_suffix}"), rows.get(f"snapshard {suffix}")),
                ">= 1.5",
            )
        )
    libs = [
        ("snapshard", "", "<= 1.05"),
        ("snapshard", ", verify=False", ""),
        ("snapshard", once, "<= 1.05"),
        ("DCP", "", ""),
    ]
    for label, suffix in restores[1:]:
        for lib, variant, target in libs:
            if f"{lib} {suffix}{variant}" not in nbytes:
                continue
            read, needed = nbytes[f"{lib} {suffix}{variant}"]
            checks.append(
                (
                    f"bytes read / needed, {label[8:]}: {lib}{variant}",
                    [read / needed] if needed else [],
                    target,
                )
            )
    bc.ratio_table("Targets: times and bytes (paired by round, then the median)", checks)
    per_save = []
    for name, per_rank in counts.items():
        if "save" in name:
            target = "<= 0" if name.startswith("snapshard") else ""
            most = max(_total(c["collectives"]) for c in per_rank)
            per_save.append((f"{name}: collectives (max over ranks)", [float(most)], target))
    bc.ratio_table("Targets: collectives per save", per_save, nd=0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reshard-ranks", type=int, default=None, help="phase 2's world size")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument("--phase", choices=("save", "reshard"), default="save", help=argparse.SUPPRESS)
    ap.add_argument("--saved-ranks", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    ranks2 = args.reshard_ranks or (1 if args.ranks > 1 else 2)
    if ranks2 == args.ranks:
        raise SystemExit("--reshard-ranks must differ from --ranks")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"torch-{stamp}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    print(f"results: {out_path}; checkpoints under {bc.ckpt_dir('torch')}", flush=True)
    root = bc.ckpt_dir("torch")
    bc.remove(root)
    try:
        res1 = _spawn(args, args.ranks, "save")
        res2 = _spawn(args, ranks2, "reshard")
    finally:
        bc.remove(root)
    with open(out_path, "a") as f:
        for phase, res in (("save", res1), ("reshard", res2)):
            meta = {"phase": phase, "ranks": args.ranks, "reshard_ranks": ranks2}
            f.write(json.dumps({**meta, "scale": args.scale, **res}) + "\n")
    _report(args, ranks2, res1, res2)


if __name__ == "__main__":
    main()
