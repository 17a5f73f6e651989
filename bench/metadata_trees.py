"""bench_metadata.py's pipeline-parallel job (`--stages S`): a save of differing trees.

The simulated job's arrays are cut into S pipeline stages by layer: the embedding goes to
the first stage, the unembedding and the final norm to the last, the transformer layers in
S contiguous groups, and the fully replicated scalars (step counters, loss scale) to every
stage under the same keys (as each stage's optimiser keeps its own step). Stage s lives on
processes [s P/S, (s+1) P/S): its arrays on the sub-mesh (dp, P/(S dp), tp=8) of them (dp
falls back to gcd(dp, P/S) where P/S is not a multiple of it), so each process's tree holds
only its stage's keys and every process of a stage holds the same tree.

Each process writes what a save with SaveOptions(trees_differ=True) writes, with the
library's functions: its plan is write_plan.plan_by_holders of its own tree (the same on
every process of the stage, so it is made once per stage), its record file numbers its own
tree's leaves (bench_metadata.Writes of the stage's plan), its tree file is
saving.files.tree_file's, and its report carries the report digest write_own computes. Process
0's commit is saving.commit.commit_save with trees_differ=True, which (saving.agreement.read_union) reads one tree
file and one record file per distinct digest through the storage, deletes the tree files (one per stage),
merges the trees (tree_union.union) and writes a format-2.2 manifest with its leaf map.

The library refuses SaveOptions(trees_differ=True) with its JAX adapter in saving.blocking._prepare
(a JAX tree is global); the bench enters after that, at the commit, with an adapter that
says trees_differ (the metadata are those of DTensors on each stage's sub-mesh: a "mesh"
layout per stage mesh).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

LIST_PAGE = 1000  # names per listing request, and per batched delete (S3 DeleteObjects)


# ---------------------------------------------------------------- which arrays each stage holds
def stage_dp(dp: int, processes: int) -> int:
    """The dp axis of a (sub-)mesh of `processes` processes: dp where it divides them."""
    return math.gcd(dp, processes)


def stages_of_arrays(n_arrays: int, stages: int) -> list[tuple[int, ...]]:
    """Per array of bench_planning.tree_arrays(n_arrays), the stages that hold it.

    tree_arrays lists the embedding (3 arrays: parameter, mu, nu), the unembedding (3), the
    final norm (3), then layers of 27 arrays, then replicated scalars."""
    from bench_planning import tree_arrays

    arrays = tree_arrays(n_arrays)
    head = 9
    scalars = sum(1 for shape, _, _ in arrays if shape == ())
    layers = (len(arrays) - head - scalars) // 27
    assert head + 27 * layers + scalars == len(arrays), (len(arrays), layers, scalars)
    last = stages - 1
    out: list[tuple[int, ...]] = [(0,)] * 3 + [(last,)] * 6
    for layer in range(layers):
        out += [(layer * stages // max(layers, 1),)] * 27
    out += [tuple(range(stages))] * scalars
    return out


def stage_processes(n: int, stages: int, stage: int) -> tuple[int, int]:
    """(first process, process count) of a stage."""
    if n % stages:
        raise SystemExit(f"{n} processes do not split into {stages} stages")
    m = n // stages
    return stage * m, m


# ---------------------------------------------------------------- what each stage writes
class TreesAdapter:
    """The adapter process 0 commits with: trees_differ (the layouts' descriptions are set
    on their memos by bench_metadata.job, so nothing else is asked of it)."""

    trees_differ = True

    def mesh_of(self, arr: Any) -> None:
        return None

    def release(self) -> None:
        pass


@dataclass
class Stage:
    """One pipeline stage: its tree (as every process of it holds it) and what each of its
    processes writes."""

    index: int
    first: int  # its first process
    count: int  # its processes
    structure: Any
    leaves: list[Any]
    plan: Any  # write_plan.plan_by_holders of its tree
    digests: np.ndarray  # saving.leaf_digests
    writes: Any  # bench_metadata.Writes of its plan (valid for its processes only)
    digest: int  # the report digest (saving.files.write_own's)
    tree_file: bytes  # saving.files.tree_file's bytes (the same on every process of the stage)
    plan_s: float
    tree_file_s: float

    def prepared(self, storage: Any, rendezvous: Any) -> Any:
        """saving.state.PreparedSave of a process of this stage, as the save left it for the commit."""
        from snapshard import saving
        from snapshard.options import SaveOptions

        return saving.state.PreparedSave(storage, rendezvous, list(self.leaves), self.structure, self.plan,
                                [], False, SaveOptions(trees_differ=True), {}, self.digests,
                                adapter=TreesAdapter())  # fmt: skip


def build_stage(job: Any, writes_cls: Any, n: int, n_arrays: int, dp: int, stages: int,
                stage: int) -> Stage:  # fmt: skip
    """Stage `stage` of the job: `job` (bench_metadata.job) makes its tree, `writes_cls`
    (bench_metadata.Writes) what its processes write."""
    import json

    from snapshard import saving
    from snapshard.checksum import crc32c
    from snapshard.planning import write_plan
    from snapshard.planning.write_plan import plan_by_holders

    first, count = stage_processes(n, stages, stage)
    structure, leaves, layouts, _ = job(n, n_arrays, dp, stages, stage)
    t0 = time.perf_counter()
    keys = [saving.path_json(a.path) for a in leaves]  # as saving.blocking._prepare passes them
    plan = plan_by_holders(layouts, keys, "auto", num_processes=n)
    plan_s = time.perf_counter() - t0
    write_plan._plan_cached.cache_clear()  # the plan is held by the stage, once
    digests = saving.leaf_digests(leaves, values=True)
    writes = writes_cls(plan, leaves, digests, n)
    writes.check_against_library(first)
    writes.check_against_library(first + count // 2)
    # saving.files.write_own's report digest: equal on the processes that saved the same tree
    digest = crc32c(digests.tobytes(), crc32c(json.dumps(structure).encode()))
    st = Stage(stage, first, count, structure, leaves, plan, digests, writes, digest, b"",
               plan_s, 0.0)  # fmt: skip
    t1 = time.perf_counter()
    st.tree_file = saving.files.tree_file(st.prepared(None, None))
    st.tree_file_s = time.perf_counter() - t1
    return st


class StagedWrites:
    """bench_metadata.Writes' view of the whole job: each process's files are its stage's."""

    def __init__(self, stages: list[Stage], n: int):
        self.stages, self.n = stages, n
        self.size = stages[0].count
        of = np.arange(n) // self.size
        self.record_sizes = np.array([stages[s].writes.record_sizes[q] for q, s in enumerate(of)])
        self.data_sizes = np.array([stages[s].writes.data_sizes[q] for q, s in enumerate(of)])
        self.nonces = stages[0].writes.nonces

    def stage_of(self, q: int) -> Stage:
        return self.stages[q // self.size]

    def record_file(self, q: int) -> bytes:
        return self.stage_of(q).writes.record_file(q)

    def tree_name(self, q: int) -> str:
        """Process q's tree file: named by its content, one per stage (saving.files.write_own)."""
        from snapshard.checksum import crc32c
        from snapshard.format.naming import tree_file_name

        doc = self.stage_of(q).tree_file
        return tree_file_name(f"{crc32c(doc):08x}{len(doc):x}")

    def report(self, q: int, crc: int | None = None) -> dict[str, Any]:
        st = self.stage_of(q)
        planned = int(st.plan.bytes_per_process()[q]) if st.plan.arrays else 0
        tree = self.tree_name(q)[len("index/tree-") : -len(".json")]
        return {**st.writes.report(q, st.digest, crc), "tree": tree, "planned_bytes": planned}

    def listing(self) -> dict[str, int]:
        """Every file the processes staged: data, record and tree files, with their sizes."""
        from snapshard.format import data_file_name, record_file_name

        out = {data_file_name(q, self.nonces[q], 0): int(self.data_sizes[q])
               for q in range(self.n)}  # fmt: skip
        out.update({record_file_name(q, self.nonces[q]): int(self.record_sizes[q])
                    for q in range(self.n)})  # fmt: skip
        out.update({self.tree_name(st.first): len(st.tree_file) for st in self.stages})
        return out

    def tree_names(self) -> set[str]:
        return {self.tree_name(st.first) for st in self.stages}

    def staged(self) -> dict[str, bytes]:
        """The files process 0's commit may read: every process's tree file (the same bytes
        on a stage's processes, so shared here) and the record file of each stage's first
        process (the commit reads one per distinct digest: any other read fails)."""
        from snapshard.format import record_file_name

        out: dict[str, bytes] = {}
        for st in self.stages:
            out[self.tree_name(st.first)] = st.tree_file
        for st in self.stages:
            name = record_file_name(st.first, self.nonces[st.first])
            out[name] = st.writes.record_file(st.first)
        return out

    def manifest_plans(self, manifest: Any) -> list[Any]:
        """Per manifest leaf, the ArrayWritePlan of the copy the manifest describes (the first
        stage's that holds it: tree_union keeps the first tree's copy)."""
        lm = manifest.processes.leaf_map
        plans: list[Any] = [None] * len(manifest.leaves)
        for st in reversed(self.stages):
            for i, g in enumerate(lm.trees[int(lm.tree_of[st.first])].tolist()):
                plans[g] = st.plan.arrays[i]
        assert all(p is not None for p in plans)
        return plans


# ---------------------------------------------------------------- process 0's storage
def commit_storage(base: type, url: str, latency: float, listing: dict[str, int],
                   files: dict[str, bytes], deletable: set[str]) -> Any:  # fmt: skip
    """bench_metadata's commit storage for a save of differing trees: the listing, reads of
    the staged files in `files` (one request each), deletions batched as an object store's
    client sends them (ObjectStorage.delete_staging_files: one HEAD of the commit marker,
    then DeleteObjects of up to 1,000 keys: S3 and obstore; the GCS client deletes one blob
    per request, see `deleted`). `deletable`: the names it may delete (the tree files)."""

    class TreesCommitStorage(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__(url, latency)
            self.listing = dict(listing)
            self.read_names: list[str] = []
            self.deleted = 0  # names deleted (the GCS client: one request each)

        def list_staging(self) -> dict[str, int]:
            self._request(max(1, -(-len(self.listing) // LIST_PAGE)))
            return dict(self.listing)

        def read_staging(self, name: str) -> bytes:
            data = files.get(name)
            if data is None:
                raise AssertionError(f"the committer read {name}: one per distinct tree expected")
            self._request()
            with self._lock:
                self.bytes_read += len(data)
                self.read_names.append(name)
            return data

        def delete_staging_files(self, names: Sequence[str]) -> None:
            names = list(names)
            bad = [n for n in names if n not in deletable]
            assert not bad, f"no stale files expected: {bad[:3]}"
            self._request(1 + -(-len(names) // LIST_PAGE))
            for n in names:
                self.listing.pop(n, None)
            self.deleted += len(names)

    return TreesCommitStorage()


# ---------------------------------------------------------------- readers
def wanted_leaves(manifest: Any, stages: int, stage: int) -> list[Any]:
    """The manifest's leaves a restoring process of stage `stage` asks for: its own tree's
    (format.leaf_map), all of them without a leaf map."""
    lm = manifest.processes.leaf_map if manifest.processes is not None else None
    if lm is None:
        return list(manifest.arrays)
    q = stage * (manifest.process_count // stages)  # a saving process of that stage
    return [manifest.leaves[g] for g in lm.trees[int(lm.tree_of[q])].tolist()]


def reader_targets(n: int, stages: int) -> list[tuple[str, int, int]]:
    """(name, processes of the restoring job, the restoring process) of each reader: the save
    mesh ("same") and a job of half the processes ("P/2", each stage halved), where its
    stages split evenly."""
    out = [("same", n, n // 2 + 1)]
    if (n // 2) % stages == 0:
        out.append(("P/2", n // 2, n // 4 + 1))
    return out
