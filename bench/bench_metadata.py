"""Format v2 metadata at scale: the real manifest, record files, commit and reader-side
lookups of a simulated job of 1,000 to 10,000 processes x 2,000 arrays, built with the
library's own code and no devices.

The simulated job is bench_planning.py's (8 devices per process, mesh (dp=2, fsdp=P/2,
tp=8), a transformer's training state), with every sharded axis rounded up to a multiple of
its shard count, as JAX requires of a NamedSharding. Per process count, in fresh
subprocesses (peak RSS is per process):

  build    layouts (format.layouts.Mesh descriptions, checked with mesh_layout and
           same_holders as saving.leaves._description does), plan_writes, and each process's
           report: record file size (exact, from the plan) and data file size (one data file
           per process: a save with SaveOptions(writers=1)). Record files are never written: a storage
           object synthesises process q's file on demand with format.records.encode of the
           records that process would write (same bytes, checked against format.records.records_of),
           caching only the byte ranges a reader asked for.
  commit   process 0: Rendezvous.gather of the P reports through an in-memory coordinator,
           saving.commit.commit_save (agreement, describe_leaves, validate_structure, staged-file check,
           commit) on a storage that sleeps 10 ms per request (a listing costs one request
           per 1,000 names, the commit a manifest PUT and a marker PUT), the outcome
           published (then, untimed, the other P-1 processes read it, as they would: the keys
           left behind are counted after that). Time and peak RSS (VmHWM, reset just before; "abs" includes the plan
           that process 0 holds anyway, "+" is what the commit added). Reading another
           process's record file would raise.
  read     a restoring process: format.reading.read_checkpoint (parse + validate + finder),
           reading.chunk_tables (ChunkFinder: candidates, directory entries and segments
           with ranged reads, checks) and reading.plan_reads, on a storage that replays
           the ranges the build step served, 10 ms per request. Targets: the save mesh
           ("same", process P/2+1) and P/2 processes ("P/2", mesh (dp, P/4, 8), process
           P/4+1). "needed" = the records of the chunks its boxes overlap plus one directory
           entry per (writer, leaf) among them: what a reader that knew exactly would read.

record crc32c values in the manifest are exact for the processes whose files were
synthesised; for the others a stand-in of the same size (the committer copies them; only
`snapshard verify` reads them).

--stages S (default 1: the job above, one tree on every process): the same job as S
pipeline stages, a save with SaveOptions(trees_differ=True) (metadata_trees.py). The arrays
are cut into S groups of layers, stage s's on the sub-mesh (dp, P/(S dp), 8) of its P/S
processes, so each process's tree holds its stage's keys only. Per stage, the plan is
write_plan.plan_by_holders of its tree, each process's record file numbers its own tree's
leaves, its tree file is saving.files.tree_file's; process 0's commit (saving.commit.commit_save) reads one
tree file and one record file per distinct report digest through the storage (10 ms per
request), deletes the tree files (one per distinct tree; one request per 1,000 names and one HEAD, as S3's batched
delete; the GCS client sends one per name: shown apart) and writes a format-2.2 manifest
with its leaf map. Readers restore their own stage's tree on their stage's sub-mesh; "P/2"
(each stage halved) only where P/2 splits into S stages. A list (--stages 1,8) measures each
and prints them side by side.

usage: python bench_metadata.py [--processes 1000,4000,10000] [--arrays 2000] [--repeat 3]
                                [--stages 1] [--latency-ms 10] [--smoke] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

DEVICES_PER_PROCESS = 8
LIST_PAGE = 1000  # names per listing request on an object store
NAMES_RE = re.compile(r"^index/p(\d+)-([0-9a-f]{8})\.idx$")
# The issue's v1 figures (library code, same simulated job): P -> (manifest bytes,
# commit s, commit RSS bytes, read s, read RSS bytes, parsed/needed).
V1_ISSUE = {
    1024: (5.86e9, 370.0, 25e9, 201.0, 24e9, 787),
    4096: (9.38e9, 1360.0, 61e9, 441.0, 54e9, 2830),
}
TARGETS = {"manifest": 4e6, "commit_s": 2.0, "commit_rss": 1e9, "read_ratio": 1.5,
           "read_s": 1.0, "read_rss": 1e9}  # fmt: skip


# ---------------------------------------------------------------- memory
def _hwm_reset() -> None:
    """Reset this process's peak RSS (Linux: VmHWM) so that a phase can be measured."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return _status("VmHWM")


def rss() -> int:
    return _status("VmRSS")


# ---------------------------------------------------------------- the simulated job
def job(n: int, n_arrays: int, dp: int, stages: int = 1,
        stage: int = 0) -> tuple[Any, list[Any], list[Any], Any]:  # fmt: skip
    """Leaves (SaveArray, as the JAX adapter makes them), their shared layouts, the tree
    structure and the save mesh's format description. With `stages` > 1: the tree of the
    processes of pipeline stage `stage` (metadata_trees.py), on its sub-mesh."""
    from bench_planning import Mesh as SimMesh
    from bench_planning import layout, tree_arrays
    from metadata_trees import stage_dp, stage_processes, stages_of_arrays
    from snapshard.dtypes import NAME_TO_DTYPE
    from snapshard.format.layouts import Mesh, describe_rows, mesh_layout, same_holders
    from snapshard.planning import ArrayLayout
    from snapshard.saving.save_array import SaveArray
    from snapshard.tree import flatten

    first, m = stage_processes(n, stages, stage)
    dp = stage_dp(dp, m) if stages > 1 else dp
    mesh = SimMesh(dp, m // dp, DEVICES_PER_PROCESS)
    fmesh = Mesh(("dp", "fsdp", "tp"), (dp, m // dp, DEVICES_PER_PROCESS),
                 first + np.arange(m * DEVICES_PER_PROCESS, dtype=np.int64) // DEVICES_PER_PROCESS)  # fmt: skip
    held = stages_of_arrays(n_arrays, stages) if stages > 1 else None
    arrays = []
    for shape, itemsize, spec in tree_arrays(n_arrays):
        padded = list(shape)
        for dim, axes in enumerate(spec):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
            k = math.prod(mesh.shape[a] for a in axes)
            padded[dim] = -(-padded[dim] // k) * k
        arrays.append((tuple(padded), itemsize, spec))
    cache: dict[Any, Any] = {}
    leaves_in: dict[str, dict[str, Any]] = {"params": {}, "mu": {}, "nu": {}}
    for i, a in enumerate(arrays):
        if held is not None and stage not in held[i]:
            continue
        group = ("params", "mu", "nu")[i % 3] if a[2] else "params"
        leaves_in[group][f"a{i:05d}"] = np.float32(0)
    flat = flatten(leaves_in, lambda x: isinstance(x, np.generic))
    order = {f"a{i:05d}": a for i, a in enumerate(arrays)}
    out = []
    for path in flat.paths:
        shape, itemsize, spec = order[str(path[-1])]
        key = (shape, itemsize, spec)
        if key not in cache:
            la = layout(shape, itemsize, spec, mesh)
            if first:  # the stage's sub-mesh: its processes
                la = ArrayLayout(la.shape, la.itemsize, la.starts, la.stops, la.replica_ids,
                                 la.process_ids + first)  # fmt: skip
            fspec = [[] if s is None else [s] if isinstance(s, str) else list(s) for s in spec]
            derived = mesh_layout(fmesh, fspec, shape, itemsize, str(path))
            # what saving.leaves._description decides from the jax sharding, from the same functions
            if same_holders(derived.shards, la.shards):
                la.memo.description = ({"kind": "mesh", "spec": fspec}, fmesh)
            else:
                la.memo.description = (describe_rows(la), None)
            cache[key] = la
        la = cache[key]
        sharding = {"type": "NamedSharding", "num_devices": m * DEVICES_PER_PROCESS,
                    "mesh": mesh.shape,
                    "spec": [None if s is None else s if isinstance(s, str) else list(s)
                             for s in spec]}  # fmt: skip
        dt = NAME_TO_DTYPE["bfloat16" if itemsize == 2 else "float32"]
        out.append(SaveArray(path, "array", dt, shape, la, (), None, sharding))
    return flat.structure, out, [a.layout for a in out], fmesh


# ---------------------------------------------------------------- what each process writes
class Writes:
    """Per process: record file size and data file size from the plan (all processes, array
    operations), and the exact record file of any process on demand (format.records.encode)."""

    def __init__(self, plan: Any, leaves: list[Any], digests: np.ndarray, n: int):
        from snapshard.format import records
        from snapshard.format.encoding import chunk_span

        self.plan, self.leaves, self.digests, self.n = plan, leaves, digests, n
        self.ndims = [len(leaf.shape) for leaf in leaves]
        rec_bytes = np.zeros(n, np.int64)
        data = np.zeros(n, np.int64)
        for a, nd in zip(plan.arrays, self.ndims, strict=True):
            writer = a.groups.cand_process[a.cand]  # not a.writer: that one stays cached
            keep = a.nbytes > 0
            uniq, inv = np.unique(a.nbytes[keep], return_inverse=True)
            span = np.array([chunk_span(int(x)) for x in uniq], np.int64)[inv]
            rec_bytes += np.bincount(writer[keep], minlength=n) * records.record_dtype(nd).itemsize
            data += np.bincount(writer[keep], weights=span, minlength=n).astype(np.int64)
        self.record_sizes = (
            rec_bytes
            + records.HEADER_SIZE
            + len(leaves) * (records.DIR_ENTRY_SIZE + records.DIGEST.itemsize)
        )
        self.data_sizes = data
        self.nonces = [f"{(q * 2654435761 + 12345) % (1 << 32):08x}" for q in range(n)]

    def segments(self, q: int) -> dict[int, np.ndarray]:
        """The records process q writes, per leaf, as saving.files.write_own builds them with
        one writer: items in plan order, written largest first (chunk_files.cut_files), each
        chunk followed by its checksums (format.encoding.chunk_span), records sorted by box."""
        from snapshard.format import checksum_block, records
        from snapshard.format.encoding import chunk_span

        per: list[tuple[int, np.ndarray]] = []
        for i, a in enumerate(self.plan.arrays):
            ks = a.items_of(q)
            ks = ks[a.nbytes[ks] > 0]
            if len(ks):
                per.append((i, ks))
        if not per:
            return {}
        leaf_of = np.concatenate([np.full(len(ks), i) for i, ks in per])
        nbytes = np.concatenate([self.plan.arrays[i].nbytes[ks] for i, ks in per])
        order = np.argsort(-nbytes, kind="stable")  # sorted(..., key=-nbytes) is stable too
        uniq, inv = np.unique(nbytes, return_inverse=True)
        span = np.array([chunk_span(int(x)) for x in uniq], np.int64)[inv]
        block = np.array([checksum_block(int(x)) for x in uniq], np.int64)[inv]
        offset = np.empty(len(nbytes), np.int64)
        offset[order] = np.cumsum(span[order]) - span[order]
        out: dict[int, np.ndarray] = {}
        pos = 0
        del leaf_of
        for i, ks in per:
            sl = slice(pos, pos + len(ks))
            pos += len(ks)
            a = self.plan.arrays[i]
            r = np.zeros(len(ks), records.record_dtype(self.ndims[i]))
            r["offset"], r["nbytes"], r["block"] = offset[sl], nbytes[sl], block[sl]
            r["nblocks"] = -(-nbytes[sl] // block[sl])
            r["crc_offset"] = offset[sl] + nbytes[sl]
            if self.ndims[i]:
                r["start"], r["stop"] = a.starts[ks], a.stops[ks]
                r = r[np.lexsort(r["start"].T[::-1])] if len(r) > 1 else r
            out[i] = r
        return out

    def record_file(self, q: int) -> bytes:
        from snapshard.format import record_file_name as records_name
        from snapshard.format import records
        from snapshard.format.binding import name_key

        salt = name_key(records_name(q, self.nonces[q]))
        data = records.encode(q, self.ndims, self.segments(q), self.digests, salt=salt)
        assert len(data) == self.record_sizes[q], (q, len(data), self.record_sizes[q])
        return data

    def check_against_library(self, q: int) -> None:
        """The vectorised records equal format.records.records_of of the rows write_chunk returns."""
        from snapshard.format.records import records_of

        for i, segment in self.segments(q).items():
            rows = [(0, 0, int(r["offset"]), int(r["nbytes"]), int(r["block"]), int(r["nblocks"]),
                     int(r["crc_offset"]), r["start"].tolist(), r["stop"].tolist())
                    for r in segment[::-1]]  # fmt: skip
            lib = records_of(rows, self.ndims[i])
            assert lib.tobytes() == segment.tobytes(), f"records of leaf {i} differ"

    def report(self, q: int, digest: int, crc: int | None = None) -> dict[str, Any]:
        from snapshard.checksum import crc32c

        return {
            "nonce": self.nonces[q],
            "sizes": [int(self.data_sizes[q])],
            "record_size": int(self.record_sizes[q]),
            "record_crc": crc if crc is not None else crc32c(b"stand-in %d" % q),
            "digest": digest,
        }


# ---------------------------------------------------------------- storage and coordinator
def _storage_base() -> type:
    from snapshard.errors import CheckpointNotFoundError
    from snapshard.storage import Storage

    class Slow(Storage):
        """An object store seen from one process: every request costs `latency` seconds."""

        def __init__(self, url: str, latency: float):
            self.url, self.latency = url, latency
            self.requests = 0
            self.bytes_read = 0
            self.manifest: bytes | None = None
            self._lock = threading.Lock()

        def _request(self, n: int = 1) -> None:
            with self._lock:
                self.requests += n
            time.sleep(self.latency * n)

        def prepare_staging(self) -> None:
            pass

        def open_writer(self, name: str) -> Any:
            raise NotImplementedError

        def list_staging(self) -> dict[str, int]:
            raise NotImplementedError

        def read_staging(self, name: str) -> bytes:
            raise AssertionError(f"the committer read {name}: commit must not read records")

        def delete_staging_files(self, names: Sequence[str]) -> None:
            raise AssertionError(f"no stale files expected: {list(names)[:3]}")

        def commit(self, manifest: bytes, *, overwrite: bool) -> None:
            self._request(2)  # the manifest PUT, then the COMMITTED marker
            self.manifest = manifest

        def discard_staging(self) -> None:
            pass

        def is_committed(self) -> bool:
            return self.manifest is not None

        def read_manifest(self) -> bytes:
            if self.manifest is None:
                raise CheckpointNotFoundError(self.url)
            self._request(2)  # the marker, then the manifest
            with self._lock:
                self.bytes_read += len(self.manifest)
            return self.manifest

        def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
            raise NotImplementedError

        def delete(self) -> None:
            raise NotImplementedError

    return Slow


def commit_storage(url: str, latency: float, listing: dict[str, int]) -> Any:
    class CommitStorage(_storage_base()):  # type: ignore[misc]
        def list_staging(self) -> dict[str, int]:
            self._request(max(1, -(-len(listing) // LIST_PAGE)))
            return dict(listing)

    return CommitStorage(url, latency)


def synth_storage(url: str, writes: Writes, manifest: bytes) -> Any:
    """Record files made on demand; remembers every range served (for the replay)."""

    class SynthStorage(_storage_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(url, 0.0)
            self.manifest = manifest
            self.served: dict[tuple[str, int, int], bytes] = {}
            self.files: dict[int, bytes] = {}
            self.crcs: dict[int, int] = {}

        def file(self, q: int) -> bytes:
            from snapshard.checksum import crc32c

            with self._lock:
                data = self.files.get(q)
            if data is None:
                data = writes.record_file(q)
                with self._lock:
                    if len(self.files) > 16:
                        self.files.pop(next(iter(self.files)))
                    self.files[q] = data
                    self.crcs[q] = crc32c(data)
            return data

        def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
            m = NAMES_RE.match(name)
            assert m, name
            data = self.file(int(m.group(1)))
            n = sum(len(b) for b in buffers)
            chunk = data[offset : offset + n]
            assert len(chunk) == n, (name, offset, n, len(data))
            with self._lock:
                self.served[(name, offset, n)] = chunk
            pos = 0
            for b in buffers:
                b[:] = chunk[pos : pos + len(b)]
                pos += len(b)

    return SynthStorage()


def replay_storage(url: str, latency: float, manifest: bytes, served: dict[Any, bytes]) -> Any:
    class ReplayStorage(_storage_base()):  # type: ignore[misc]
        def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
            n = sum(len(b) for b in buffers)
            chunk = served[(name, offset, n)]
            self._request()
            with self._lock:
                self.bytes_read += n
            pos = 0
            for b in buffers:
                b[:] = chunk[pos : pos + len(b)]
                pos += len(b)

    s = ReplayStorage(url, latency)
    s.manifest = manifest
    return s


def coordinator(n: int, index: int = 0, shared: Any = None) -> Any:
    from snapshard.coordination.base import SingleProcessCoordinator

    class Counting(SingleProcessCoordinator):
        """Process `index` of n: the key-value store in memory (shared with `shared`), each
        request counted (one round trip each on a real coordination service)."""

        def __init__(self) -> None:
            super().__init__()
            self.process_count, self.process_index = n, index
            if shared is not None:
                self._kv, self._cond = shared._kv, shared._cond
            self.gets = 0

        def get(self, key: str, timeout_s: float) -> str:
            self.gets += 1
            return super().get(key, timeout_s)

        def get_dir(self, prefix: str) -> dict[str, str]:
            self.gets += 1
            return super().get_dir(prefix)

    return Counting()


# ---------------------------------------------------------------- the reader's boxes
def target_dests(manifest: Any, n_target: int, p: int, dp: int, stages: int = 1) -> list[Any]:
    """reading.Dest of every unique box process p of an n_target-process job (mesh (dp,
    n_target/dp, 8)) holds, as reading.request_boxes makes them from the target sharding.
    With `stages` > 1: the boxes of its stage's tree on its stage's sub-mesh (dp,
    n_target/(stages dp), 8), the stage's leaves found through the leaf map."""
    from metadata_trees import stage_dp, stage_processes, wanted_leaves
    from snapshard import reading as restore
    from snapshard.format.layouts import Mesh, mesh_layout

    stage = p // (n_target // stages)
    first, m = stage_processes(n_target, stages, stage)
    dp = stage_dp(dp, m) if stages > 1 else dp
    tmesh = Mesh(("dp", "fsdp", "tp"), (dp, m // dp, DEVICES_PER_PROCESS),
                 first + np.arange(m * DEVICES_PER_PROCESS, dtype=np.int64) // DEVICES_PER_PROCESS)  # fmt: skip
    boxes: dict[Any, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    boxes_of = []
    for leaf in wanted_leaves(manifest, stages, stage):
        desc = manifest.layouts[leaf.layout]
        key = (json.dumps(desc), leaf.shape)
        if key not in boxes:
            assert desc["kind"] == "mesh", desc["kind"]
            la = mesh_layout(tmesh, desc["spec"], leaf.shape, 1, leaf.name)
            rows = np.flatnonzero(la.process_ids == p)
            nd = len(leaf.shape)
            u = np.unique(np.concatenate([la.starts[rows], la.stops[rows]], axis=1), axis=0)
            # One array per box, shared by every leaf of this layout and shape, as
            # request_boxes shares a box plan's (the planner's caches go by these objects).
            boxes[key] = (list(u[:, :nd]), list(u[:, nd:]))
        itemsize = 2 if leaf.dtype == "bfloat16" else 4
        for s, e in zip(*boxes[key], strict=True):
            boxes_of.append((leaf, s, e, int(np.prod(e - s)) * itemsize))
    # The planner never touches a destination's memory, so every box gets a view of one
    # buffer: a buffer each would put the process's whole share of the state in the heap,
    # where the allocator's headers fault in huge pages (GBs of RSS that a real restore
    # spends on the data it reads, not on planning).
    scratch = np.empty(max((n for *_, n in boxes_of), default=0), np.uint8)
    return [restore.Dest(leaf, s, e, scratch[:n]) for leaf, s, e, n in boxes_of]


def needed_bytes(plans: Sequence[Any], manifest: Any, dests: list[Any]) -> tuple[int, int, int]:
    """(record bytes, directory entry bytes, record files) a reader of `dests` needs at
    least: the records of the chunks its boxes overlap, one entry per (writer, leaf).
    `plans`: per manifest leaf, the ArrayWritePlan of the copy the manifest describes."""
    from snapshard.format import records
    from snapshard.planning import ChunkIndex

    index_of = {id(leaf): i for i, leaf in enumerate(manifest.leaves)}
    indexes: dict[int, Any] = {}
    chunks: dict[int, set[int]] = {}
    for d in dests:
        a = index_of[id(d.leaf)]
        pa = plans[a]
        ix = indexes.get(id(pa.starts))
        if ix is None:
            ix = indexes[id(pa.starts)] = ChunkIndex(pa.starts, pa.stops)
        over = ix.overlapping(d.start, d.stop)
        chunks.setdefault(a, set()).update(int(k) for k in over if pa.nbytes[k] > 0)
    rec = entries = 0
    files: set[int] = set()
    for a, ks in chunks.items():
        pa = plans[a]
        k = np.fromiter(ks, np.int64, len(ks))
        writers = np.unique(pa.groups.cand_process[pa.cand[k]])
        files.update(writers.tolist())
        rec += len(k) * records.record_dtype(len(manifest.leaves[a].shape)).itemsize
        entries += len(writers) * records.DIR_ENTRY_SIZE
    return rec, entries, len(files)


# ---------------------------------------------------------------- children
def child_build(args: argparse.Namespace) -> dict[str, Any]:
    """Plan, reports, process 0's commit (timed), the manifest, and the ranges each reader
    target fetches (served by synthesised record files). With --stages S > 1: the
    pipeline-parallel job of metadata_trees.py, a save of differing trees."""
    import metadata_trees as trees
    import snapshard.saving as saving
    from snapshard.checksum import crc32c
    from snapshard.coordination.rendezvous import Rendezvous, namespace
    from snapshard.format import Manifest
    from snapshard.jax.save_adapter import JaxAdapter
    from snapshard.options import SaveOptions
    from snapshard.planning import plan_writes, write_plan

    n, dp, latency, n_stages = args.processes_one, args.dp, args.latency_ms / 1000, args.stages_one
    url = f"memory://bench/{n}"
    t0 = time.perf_counter()
    extra: dict[str, Any] = {"stages": n_stages}
    if n_stages == 1:
        structure, leaves, layouts, _ = job(n, args.arrays, dp)
        plan = plan_writes(layouts, "auto", num_processes=n)
        write_plan._plan_cached.cache_clear()  # the plan is held below, once
        digests = saving.leaf_digests(leaves, values=True)
        writes: Any = Writes(plan, leaves, digests, n)
        writes.check_against_library(0)
        writes.check_against_library(n // 2 + 1)
        digest = crc32c(digests.tobytes(), crc32c(json.dumps(structure).encode()))
        from snapshard.format import data_file_name, record_file_name

        rec0 = writes.record_file(0)
        reports = [writes.report(q, digest, crc32c(rec0) if q == 0 else None) for q in range(n)]
        listing = {data_file_name(q, writes.nonces[q], 0): int(writes.data_sizes[q])
                   for q in range(n)}  # fmt: skip
        listing.update({record_file_name(q, writes.nonces[q]): int(writes.record_sizes[q])
                        for q in range(n)})  # fmt: skip
        all_plans = [plan]
        extra["stage_mesh"] = [dp, n // dp, DEVICES_PER_PROCESS]

        def make_storage() -> Any:
            return commit_storage(url, latency, listing)

        def make_prep(storage: Any, rv: Any) -> Any:
            return saving.state.PreparedSave(storage, rv, list(leaves), structure, plan, [], False,
                                    SaveOptions(), {}, digests, adapter=JaxAdapter())  # fmt: skip
    else:
        stages = [trees.build_stage(job, Writes, n, args.arrays, dp, n_stages, s)
                  for s in range(n_stages)]  # fmt: skip
        writes = trees.StagedWrites(stages, n)
        from snapshard.format import data_file_name, record_file_name

        rec0 = writes.record_file(0)
        reports = [writes.report(q, crc32c(rec0) if q == 0 else None) for q in range(n)]
        listing = writes.listing()
        files, deletable = writes.staged(), writes.tree_names()
        all_plans = [st.plan for st in stages]
        m_stage = stages[0].count
        dp_stage = trees.stage_dp(dp, m_stage)
        extra.update({
            "stage_mesh": [dp_stage, m_stage // dp_stage, DEVICES_PER_PROCESS],
            "stage_arrays": [len(st.leaves) for st in stages],
            "tree_file_bytes": [len(st.tree_file) for st in stages],
            "tree_file_s": [round(st.tree_file_s, 4) for st in stages],
            "plan_by_holders_s": [round(st.plan_s, 3) for st in stages],
            "distinct_digests": len({st.digest for st in stages}),
        })  # fmt: skip

        def make_storage() -> Any:
            return trees.commit_storage(_storage_base(), url, latency, listing, files, deletable)

        def make_prep(storage: Any, rv: Any) -> Any:
            return stages[0].prepared(storage, rv)

    setup_s = time.perf_counter() - t0
    record_bytes = len(rec0)
    del rec0

    commits = []
    manifest = b""
    for _ in range(args.repeat):
        storage = make_storage()
        coord = coordinator(n)
        rv = Rendezvous(coord, namespace("save", url), f"save to {url}", 600.0)
        for q in range(1, n):  # what every other process has reported by now
            rv.report(f"written/{q}", **reports[q])
        prep = make_prep(storage, rv)
        rv.report("written/0", **reports[0])
        base = rss()
        _hwm_reset()
        c1 = time.process_time()
        t1 = time.perf_counter()
        rv.start_clock()
        others = rv.gather("written")
        saving.commit.commit_save(prep, [reports[0] if q == 0 else others[q] for q in range(n)])
        rv.publish_outcome()
        commit_s = time.perf_counter() - t1
        cpu_s = time.process_time() - c1
        peak = peak_rss()
        gets = coord.gets
        for q in range(1, n):  # the others learn the outcome (the last one deletes the keys)
            Rendezvous(coordinator(n, q, coord), rv.prefix, rv.what, 600.0).await_outcome()
        commits.append({"s": commit_s, "cpu": cpu_s, "rss": peak, "added": peak - base,
                        "requests": storage.requests, "gets": gets,
                        "keys_left": len(coord.keys()), "read_bytes": storage.bytes_read,
                        "files_read": len(getattr(storage, "read_names", ())),
                        "deleted": getattr(storage, "deleted", 0)})  # fmt: skip
        manifest = storage.manifest
        del prep, storage, coord, rv, others

    # Reader targets: run the library's finder once on synthesised record files, keep the
    # ranges it read (replayed, timed, in a fresh process) and what it needed at least.
    parsed = Manifest.from_json(manifest, url)
    plans = all_plans[0].arrays if n_stages == 1 else writes.manifest_plans(parsed)
    targets = {}
    for name, n_target, p in trees.reader_targets(n, n_stages):
        from snapshard import reading as restore
        from snapshard.format.reading import read_checkpoint

        synth = synth_storage(url, writes, manifest)
        m, finder = read_checkpoint(synth)
        dests = target_dests(m, n_target, p, dp, n_stages)
        stats = restore.ReadStats()
        restore.chunk_tables(finder, dests, stats)
        rec, ent, files_needed = needed_bytes(plans, m, dests)
        path = os.path.join(args.dir, f"served-{name.replace('/', '_')}.pkl")
        with open(path, "wb") as f:
            pickle.dump(synth.served, f)
        targets[name] = {"n_target": n_target, "process": p, "needed_records": rec,
                         "needed_entries": ent, "needed_files": files_needed,
                         "files_read": len({k[0] for k in synth.served}),
                         "boxes": len(dests)}  # fmt: skip
        del synth, m, dests
    with open(os.path.join(args.dir, "manifest.json"), "wb") as f:
        f.write(manifest)
    med = statistics.median
    return {
        "processes": n, "arrays": len(parsed.leaves), "leaves": len(parsed.leaves),
        "layouts": len(parsed.layouts), "meshes": len(parsed.meshes),
        "version": json.loads(manifest)["version"],
        "chunks": int(sum(int(np.count_nonzero(a.nbytes)) for pl in all_plans for a in pl.arrays)),
        "mode": all_plans[0].mode, "manifest_bytes": len(manifest), "record_bytes_p0": record_bytes,
        "record_bytes_max": int(writes.record_sizes.max()),
        "record_bytes_mean": float(writes.record_sizes.mean()),
        "setup_s": round(setup_s, 2),
        "commit_s": med(c["s"] for c in commits), "commit_all_s": [c["s"] for c in commits],
        "commit_cpu_s": med(c["cpu"] for c in commits),
        "commit_rss": max(c["rss"] for c in commits),
        "commit_added": max(c["added"] for c in commits),
        "commit_requests": commits[0]["requests"], "gets": commits[0]["gets"],
        "commit_read_bytes": commits[0]["read_bytes"], "commit_files_read": commits[0]["files_read"],
        "commit_deleted": commits[0]["deleted"],
        "keys_left": commits[0]["keys_left"], "targets": targets, **extra,
    }  # fmt: skip


def child_read(args: argparse.Namespace) -> dict[str, Any]:
    """A restoring process: parse the manifest, find its chunks' records, plan its reads."""
    from metadata_trees import reader_targets
    from snapshard import reading as restore
    from snapshard.format.reading import read_checkpoint

    n, dp, n_stages = args.processes_one, args.dp, args.stages_one
    url = f"memory://bench/{n}"
    with open(os.path.join(args.dir, "manifest.json"), "rb") as f:
        manifest = f.read()
    with open(os.path.join(args.dir, f"served-{args.target.replace('/', '_')}.pkl"), "rb") as f:
        served = pickle.load(f)
    n_target, p = {t: (nt, p) for t, nt, p in reader_targets(n, n_stages)}[args.target]
    base = rss()
    runs = []
    for _ in range(args.repeat):
        storage = replay_storage(url, args.latency_ms / 1000, manifest, served)
        c0, t0 = time.process_time(), time.perf_counter()
        m, finder = read_checkpoint(storage)
        c1, t1 = time.process_time(), time.perf_counter()
        dests = target_dests(m, n_target, p, dp, n_stages)  # from the target sharding: not timed
        c2, t2 = time.process_time(), time.perf_counter()
        stats = restore.ReadStats()
        tables = restore.chunk_tables(finder, dests, stats)
        t3 = time.perf_counter()
        tasks = restore.plan_reads(m.files, dests, tables, True, 4096, stats, url)
        c4, t4 = time.process_time(), time.perf_counter()
        runs.append({"parse_s": t1 - t0, "find_s": t3 - t2, "plan_s": t4 - t3,
                     "total_s": (t1 - t0) + (t4 - t2), "boxes_s": t2 - t1,
                     "cpu_s": (c1 - c0) + (c4 - c2),
                     "requests": storage.requests, "record_bytes": stats.metadata_bytes,
                     "manifest_bytes": len(manifest), "reads": len(tasks)})  # fmt: skip
        del m, dests, tables, tasks, storage
    mid = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]
    return {**mid, "total_all_s": [r["total_s"] for r in runs], "rss": peak_rss(),
            "rss_at_start": base}  # fmt: skip


def run_child(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--arrays", str(args.arrays), "--dp",
           str(args.dp), "--repeat", str(args.repeat), "--latency-ms", str(args.latency_ms),
           *extra]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"child {extra} failed with {r.returncode}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------- the table
def mb(x: float) -> str:
    return f"{x / 1e6:,.2f} MB" if x < 1e9 else f"{x / 1e9:,.2f} GB"


def table(rows: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    ns = [r["processes"] for r in rows]
    staged = any(r.get("stages", 1) > 1 for r in rows)

    def column(r: dict[str, Any]) -> str:
        return f"P = {r['processes']:,}" + (f", S = {r.get('stages', 1)}" if staged else "")

    head = "| | " + " | ".join(column(r) for r in rows) + " |"
    print(
        "\n## Format v2 metadata, measured (medians; v1 = the issue's figures at P = 1,024 / 4,096)\n"
    )
    print(head)
    print("|---" * (len(ns) + 1) + "|")

    def line(label: str, cells: list[str]) -> None:
        print(f"| {label} | " + " | ".join(cells) + " |")

    line(
        "arrays / layouts / chunks (all processes)",
        [f"{r['arrays']:,} / {r['layouts']} / {r['chunks']:,}" for r in rows],
    )
    if staged:
        line("stages: mesh of each / arrays of each (format)",
             [f"{r['stages']}: ({', '.join(map(str, r['stage_mesh']))}) / "
              f"{', '.join(f'{x:,}' for x in sorted(set(r.get('stage_arrays', [r['arrays']]))))} "
              f"({r['version']})" for r in rows])  # fmt: skip
    line("manifest.json (serialised)", [f"{r['manifest_bytes']:,} B ({mb(r['manifest_bytes'])})"
                                         for r in rows])  # fmt: skip
    line("  v1 manifest (issue figures)", [f"{mb(V1_ISSUE[1024][0])} (1,024)" if n == 1000 else
         f"{mb(V1_ISSUE[4096][0])} (4,096)" if n == 4000 else "—" for n in ns])  # fmt: skip
    line("record file: process 0 / mean / largest", [f"{mb(r['record_bytes_p0'])} / "
         f"{mb(r['record_bytes_mean'])} / {mb(r['record_bytes_max'])}" for r in rows])  # fmt: skip
    if staged:
        line("tree file per process: bytes, smallest-largest stage (saving.files.tree_file s)",
             [f"{mb(min(r['tree_file_bytes']))}-{mb(max(r['tree_file_bytes']))} "
              f"({max(r['tree_file_s']):.3f} s)" if "tree_file_bytes" in r else "—"
              for r in rows])  # fmt: skip
    line("process 0 commit: wall (CPU; storage requests)",
         [f"{r['commit_s']:.3f} s ({r['commit_cpu_s']:.3f} s; {r['commit_requests']} req.)"
          for r in rows])  # fmt: skip
    if staged:
        line("  commit: files read (bytes) / tree files deleted",
             [f"{r['commit_files_read']} ({mb(r['commit_read_bytes'])}) / "
              f"{r['commit_deleted']:,}" for r in rows])  # fmt: skip
        line("  + if each delete is a request (GCS client), at the latency",
             [f"+{r['commit_deleted'] * r['latency_ms'] / 1000:,.1f} s"
              if r.get("commit_deleted") else "—" for r in rows])  # fmt: skip
    line("  v1 merge + validate + commit (issue)", [f"{V1_ISSUE[1024][1]:,.0f} s" if n == 1000 else
         f"{V1_ISSUE[4096][1]:,.0f} s" if n == 4000 else "—" for n in ns])  # fmt: skip
    line(
        "process 0 peak RSS in commit: abs / added",
        [f"{mb(r['commit_rss'])} / {mb(r['commit_added'])}" for r in rows],
    )
    line("  v1 process 0 peak RSS (issue)", [mb(V1_ISSUE[1024][2]) if n == 1000 else
         mb(V1_ISSUE[4096][2]) if n == 4000 else "—" for n in ns])  # fmt: skip
    line("coordination: process 0's requests / keys left", [f"{r['gets']:,} / {r['keys_left']:,}"
                                                       for r in rows])  # fmt: skip
    for t in ("same", "P/2"):
        rs = [(r["targets"].get(t), r["read"].get(t)) for r in rows]

        def cells(fn: Any, rs: list[Any] = rs) -> list[str]:
            return [fn(x, y) if x is not None else "—" for x, y in rs]

        line(f"reader ({t}): process / of processes", cells(
            lambda x, _: f"{x['process']:,} / {x['n_target']:,}"))  # fmt: skip
        line(f"reader ({t}): boxes / record files read", cells(
            lambda x, _: f"{x['boxes']:,} / {x['files_read']}"))  # fmt: skip
        line(f"reader ({t}): records + entries read / needed", cells(
            lambda x, y: f"{mb(y['record_bytes'])} / {mb(x['needed_records'] + x['needed_entries'])} "
            f"({y['record_bytes'] / max(x['needed_records'] + x['needed_entries'], 1):.2f}x)"))  # fmt: skip
        line(f"reader ({t}): + manifest", cells(lambda _, y: mb(y["manifest_bytes"])))
        line(f"reader ({t}): parse + find + plan, wall", cells(
            lambda _, y: f"{y['total_s']:.3f} s ({y['parse_s']:.3f} + {y['find_s']:.3f} + "
            f"{y['plan_s']:.3f}; {y['requests']} req.)"))  # fmt: skip
        line(f"reader ({t}): CPU", cells(lambda _, y: f"{y['cpu_s']:.3f} s"))
        line(f"reader ({t}): peak RSS (at start)", cells(
            lambda _, y: f"{mb(y['rss'])} ({mb(y['rss_at_start'])})"))  # fmt: skip
    line("  v1 reader read + parse + validate / RSS (issue)",
         [f"{V1_ISSUE[1024][3]:,.0f} s / {mb(V1_ISSUE[1024][4])}" if n == 1000 else
          f"{V1_ISSUE[4096][3]:,.0f} s / {mb(V1_ISSUE[4096][4])}" if n == 4000 else "—"
          for n in ns])  # fmt: skip
    checks: list[tuple[str, str, str, str]] = []
    for big in (r for r in rows if r["processes"] == max(ns)):
        checks += targets(big, staged)
    return checks


def targets(big: dict[str, Any], staged: bool) -> list[tuple[str, str, str, str]]:
    """The targets table of one row (the largest process count)."""
    checks: list[tuple[str, str, str, str]] = []

    def check(what: str, value: float, target: float, shown: str, tshown: str) -> None:
        checks.append((what, shown, tshown, "yes" if value <= target else "no"))

    check(
        "manifest", big["manifest_bytes"], TARGETS["manifest"], mb(big["manifest_bytes"]), "≤ 4 MB"
    )
    check("commit time, process 0", big["commit_s"], TARGETS["commit_s"],
          f"{big['commit_s']:.3f} s", "≤ 2 s")  # fmt: skip
    check("commit peak RSS, process 0 (abs)", big["commit_rss"], TARGETS["commit_rss"],
          mb(big["commit_rss"]), "≤ 1 GB")  # fmt: skip
    for t in big["targets"]:
        x, y = big["targets"][t], big["read"][t]
        need = x["needed_records"] + x["needed_entries"]
        check(f"reader ({t}) metadata read / needed", y["record_bytes"] / max(need, 1),
              TARGETS["read_ratio"], f"{y['record_bytes'] / max(need, 1):.2f}x + manifest",
              "≤ 1.5x + manifest")  # fmt: skip
        check(
            f"reader ({t}) time", y["total_s"], TARGETS["read_s"], f"{y['total_s']:.3f} s", "≤ 1 s"
        )
        check(f"reader ({t}) peak RSS", y["rss"], TARGETS["read_rss"], mb(y["rss"]), "≤ 1 GB")
    check("coordination keys left behind", big["keys_left"], 0, f"{big['keys_left']:,}", "0")
    stages = f", S = {big.get('stages', 1)}" if staged else ""
    print(
        f"\n## Targets at P = {big['processes']:,}{stages} (load average then: "
        f"{', '.join(f'{x:.1f}' for x in big['load_average'])}; {os.cpu_count()} CPUs)\n"
    )
    print("| target | measured | wanted | met |")
    print("|---|---|---|---|")
    for c in checks:
        print(f"| {' | '.join(c)} |")
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--processes", default="1000,4000,10000")
    ap.add_argument("--arrays", type=int, default=2000)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--latency-ms", type=float, default=10.0, help="storage latency per request")
    ap.add_argument("--stages", default="1",
                    help="pipeline stages S (metadata_trees.py: a save of differing trees);\n"
                         "1 = one tree on every process; a list (1,8) measures each")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="P = 64 only, one run")
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument("--child", choices=("build", "read"), help=argparse.SUPPRESS)
    ap.add_argument("--processes-one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--stages-one", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = child_build(args) if args.child == "build" else child_read(args)
        print(json.dumps(result))
        return
    if args.smoke:
        args.processes, args.arrays, args.repeat = "64", 200, 1
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"metadata-{stamp}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    rows = []
    runs = [(int(n), int(s)) for n in args.processes.split(",") for s in args.stages.split(",")]
    for n, s in runs:
        with tempfile.TemporaryDirectory(prefix="snapshard-bench-") as d:
            common = ["--processes-one", str(n), "--stages-one", str(s), "--dir", d]
            row = run_child(args, "--child", "build", *common)
            row["read"] = {t: run_child(args, "--child", "read", "--target", t, *common)
                           for t in row["targets"]}  # fmt: skip
        row["load_average"] = os.getloadavg()
        row["latency_ms"] = args.latency_ms
        rows.append(row)
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    table(rows)
    print(f"\nresults: {out_path}")


if __name__ == "__main__":
    main()
