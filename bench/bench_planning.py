"""Planning at scale: one process's write plan and read plan for a simulated mesh of 1,000 to
10,000 processes x 2,000 arrays, built from metadata alone (no devices, no I/O).

The simulated job: 8 devices per process on a mesh (dp, fsdp, tp) with tp = 8 inside a
process and dp data-parallel replica groups (default 2), fsdp = processes / dp. The tree is a
transformer's training state (bf16 parameters, f32 Adam moments) of 2,000 arrays:
  parameters     2-D P('fsdp', 'tp') or P('tp', 'fsdp'): sharded over fsdp x tp, dp replicas
  Adam mu / nu   2-D P(('dp', 'fsdp'), 'tp'): sharded over every device, no replica
  norms, scalars P(): fully replicated on every process
Axes are cut evenly (pieces differ by at most one row, as a divisible mesh would cut them).
Arrays with the same shape, dtype and sharding share one ArrayLayout object, as the JAX
adapter's cache makes them.

Timed for process p = N // 2 + 1 (any process does the same work):
  write plan  plan_writes(layouts, mode) with fresh layouts (cold: nothing cached), again
              with the same layouts (cached: what a later save of an unchanged tree pays),
              and plan.process_items(p) (the process's own items; a save asks for them every time).
  read plan   the read executor's own planning (reading.plan_reads) of the process's target boxes
              against the saved chunks (the auto write plan's boxes): chunk indexes shared
              by arrays with the same chunk boxes, the overlaps, their byte runs and the
              coalesced reads. Building the inputs (chunk tables, buffers) is not timed.
              Targets: the save mesh ("same") and mesh (dp, 2 fsdp, tp / 2) ("reshard").

usage: python bench_planning.py [--processes 1000,4000,10000] [--arrays 2000] [--modes ...]
                                [--profile] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import pstats
import resource
import statistics
import time
from dataclasses import dataclass

import numpy as np

from snapshard import reading
from snapshard.format import ArrayLeaf, ChunkTable, FileEntry, Manifest, checksum_block
from snapshard.planning import (
    ArrayLayout,
    ChunkIndex,
    plan_writes,
    write_plan,
)

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICES_PER_PROCESS = 8
# Model dimensions of a large transformer (model width, kv width, MLP width, vocabulary).
D, KV, F, V = 16384, 2048, 53248, 128256


# ---------------------------------------------------------------- the simulated job
@dataclass(frozen=True)
class Mesh:
    dp: int
    fsdp: int
    tp: int

    @property
    def shape(self) -> dict[str, int]:
        return {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp}

    def coords(self) -> dict[str, np.ndarray]:
        """Mesh coordinates of every device, devices numbered row-major (dp, fsdp, tp)."""
        d = np.arange(self.dp * self.fsdp * self.tp, dtype=np.int64)
        return {
            "dp": d // (self.fsdp * self.tp),
            "fsdp": (d // self.tp) % self.fsdp,
            "tp": d % self.tp,
        }


def layout(shape: tuple[int, ...], itemsize: int, spec: tuple, mesh: Mesh) -> ArrayLayout:
    """What the JAX adapter builds from a NamedSharding: every device's box, replica id and
    process id."""
    coords = mesh.coords()
    n = len(coords["dp"])
    starts = np.zeros((n, len(shape)), dtype=np.int64)
    stops = np.tile(np.asarray(shape, dtype=np.int64), (n, 1))
    for dim, axes in enumerate(spec):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else axes
        idx = np.zeros(n, dtype=np.int64)
        count = 1
        for a in axes:  # several mesh axes on one dimension: row-major over them
            idx = idx * mesh.shape[a] + coords[a]
            count *= mesh.shape[a]
        starts[:, dim] = idx * shape[dim] // count
        stops[:, dim] = (idx + 1) * shape[dim] // count
    # Replica id: devices holding the same box, numbered in device order.
    _, box = np.unique(np.concatenate([starts, stops], axis=1), axis=0, return_inverse=True)
    box = box.reshape(-1)
    order = np.argsort(box, kind="stable")
    first = np.searchsorted(box[order], box[order], side="left")
    replica = np.empty(n, dtype=np.int64)
    replica[order] = np.arange(n) - first
    process = np.arange(n, dtype=np.int64) // DEVICES_PER_PROCESS
    return ArrayLayout(tuple(shape), itemsize, starts, stops, replica, process)


def tree_arrays(n_arrays: int) -> list[tuple[tuple[int, ...], int, tuple]]:
    """(shape, itemsize, spec) of every array of the training state."""
    param2d = {
        "wq": (D, D),
        "wk": (D, KV),
        "wv": (D, KV),
        "wo": (D, D),
        "w1": (D, F),
        "w3": (D, F),
        "w2": (F, D),
    }
    out = []

    def add(shape, is_row_parallel):
        # the parameter (bf16, replicated over dp) and its two Adam moments (f32, no replica)
        if len(shape) == 2:
            p_spec = ("tp", "fsdp") if is_row_parallel else ("fsdp", "tp")
            o_spec = ("tp", ("dp", "fsdp")) if is_row_parallel else (("dp", "fsdp"), "tp")
        else:
            p_spec = o_spec = (None,) * len(shape)
        out.append((shape, 2, p_spec))
        out.extend([(shape, 4, o_spec)] * 2)

    add((V, D), False)  # embedding
    add((D, V), False)  # unembedding
    add((D,), False)  # final norm
    while len(out) + 27 <= n_arrays:
        for name, shape in param2d.items():
            add(shape, name in ("wo", "w2"))
        add((D,), False)
        add((D,), False)
    while len(out) < n_arrays:  # step counters, loss scale ...: fully replicated scalars
        out.append(((), 4, ()))
    return out


def build_layouts(arrays, mesh: Mesh) -> list[ArrayLayout]:
    """One layout object per distinct (shape, itemsize, spec), shared by the arrays."""
    cache: dict[tuple, ArrayLayout] = {}
    for a in arrays:
        if a not in cache:
            cache[a] = layout(a[0], a[1], a[2], mesh)
    return [cache[a] for a in arrays]


# ---------------------------------------------------------------- the read plan (as jax/load.py)
def target_boxes(la: ArrayLayout, process: int) -> tuple[np.ndarray, np.ndarray]:
    """The unique boxes one process holds (replicated boxes once)."""
    rows = np.flatnonzero(la.process_ids == process)
    boxes = np.unique(np.concatenate([la.starts[rows], la.stops[rows]], axis=1), axis=0)
    return boxes[:, : la.ndim], boxes[:, la.ndim :]


def read_plan(plan, layouts, process: int, target_layouts, times: dict[str, float]) -> int:
    """the read executor's own planning (reading.plan_reads) for the process's target boxes
    against the saved chunks, as it runs inside snapshard.load: returns the number of reads.

    Arrays sharing a layout share one chunk table, as reading a manifest interns them."""
    t0 = time.perf_counter()
    tables: dict[int, ChunkTable] = {}
    leaves = []
    for i, (a, la) in enumerate(zip(plan.arrays, layouts, strict=True)):
        if id(a.starts) not in tables:
            c = len(a.nbytes)
            blocks = np.array([checksum_block(int(b)) for b in a.nbytes[:1]] * c, dtype=np.int64)
            zeros = np.zeros(c, np.int64)
            tables[id(a.starts)] = ChunkTable(a.starts, a.stops, zeros, zeros, a.nbytes, blocks, [])
        dtype = {1: "int8", 2: "bfloat16", 4: "float32"}[la.itemsize]
        leaves.append(
            ArrayLeaf((str(i),), "array", dtype, la.shape, None, None, tables[id(a.starts)])
        )
    manifest = Manifest({}, leaves, [FileEntry("data/p", 1 << 62)])
    dests = []
    for leaf, tl in zip(leaves, target_layouts, strict=True):
        ts, te = target_boxes(tl, process)
        for s, e in zip(ts, te, strict=True):
            # Unwritten buffers: the plan only needs their size (the OS allocates lazily).
            dests.append(
                reading.Dest(leaf, s, e, np.empty(int(np.prod(e - s)) * tl.itemsize, np.uint8))
            )
    t1 = time.perf_counter()
    tables = {id(leaf): leaf.chunks for leaf in leaves}
    tasks = reading.plan_reads(manifest.files, dests, tables, True, 4096, reading.ReadStats())
    times["setup_s"] += t1 - t0
    times["plan_s"] += time.perf_counter() - t1
    return len(tasks)


def scanned(chunks, targets) -> tuple[int, int]:
    """(chunks the index's two binary searches leave to filter, target boxes x chunks): how
    far the read plan is from comparing every target box with every chunk. Not timed."""
    looked = pairs = 0
    for (cs, ce, _), (ts, te) in zip(chunks, targets, strict=True):
        index = ChunkIndex(cs, ce)
        for s, e in zip(ts, te, strict=True):
            pairs += len(cs)
            if cs.shape[1] == 0:
                looked += len(cs)
                continue
            a = index.axis
            hi = int(np.searchsorted(index.sorted_starts, e[a], side="left"))
            lo = int(np.searchsorted(index.cummax_stops, s[a], side="right"))
            looked += max(hi - lo, 0)
    return looked, pairs


# ---------------------------------------------------------------- measuring
def manifest_estimate(plan, n: int) -> int:
    """Bytes of the format-v1 manifest's chunk rows for this plan (JSON, one row per chunk),
    from one representative row per array: what process 0 writes and every reader parses."""
    total = 0
    for a in plan.arrays:
        if not len(a.nbytes):
            continue
        nbytes = int(a.nbytes[0])
        block = checksum_block(nbytes)
        row = {
            "start": a.starts[0].tolist(),
            "stop": a.stops[0].tolist(),
            "file": 2 * n,
            "offset": 10**9,
            "nbytes": nbytes,
            "block": block,
            "crc32c": "0" * 8 * -(-nbytes // block),
        }
        total += (len(json.dumps(row, separators=(",", ":"))) + 1) * len(a.nbytes)
    return total


def plan_nbytes(plan) -> int:
    """Bytes of the arrays a write plan holds (shared arrays once): what every process keeps."""
    seen: dict[int, int] = {}
    for a in plan.arrays:
        for x in (a.starts, a.stops, a.writer, a.source_row, a.nbytes):
            seen[id(x)] = x.nbytes
    return sum(seen.values())


def timed(fn, profile: cProfile.Profile | None = None):
    gc.collect()
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    out = fn()
    if profile is not None:
        profile.disable()
    return out, time.perf_counter() - t0


def write_plan_times(arrays, mesh: Mesh, mode: str, n: int, p: int, prof) -> tuple:
    """Cold, cached and process_items times of one write plan, with fresh layout objects."""
    t0 = time.perf_counter()
    layouts = build_layouts(arrays, mesh)
    build_s = time.perf_counter() - t0
    plan, cold = timed(lambda: plan_writes(layouts, mode, num_processes=n), prof)
    _, cached = timed(lambda: plan_writes(layouts, mode, num_processes=n))
    mine, items_s = timed(lambda: plan.process_items(p))
    # The planner keeps its last plans (functools.lru_cache); at 10,000 processes each holds
    # gigabytes, so drop them between measurements.
    write_plan._plan_cached.cache_clear()
    return layouts, plan, build_s, cold, cached, items_s, len(mine)


def bench_one(n, n_arrays, modes, dp, repeat, profile, emit) -> None:
    mesh = Mesh(dp, n // dp, DEVICES_PER_PROCESS)
    arrays = tree_arrays(n_arrays)
    p = n // 2 + 1
    prof = cProfile.Profile() if profile else None
    med = statistics.median
    for mode in modes:
        runs = []
        for _ in range(repeat):
            layouts = plan = None  # let the previous run's plan go first (memory)
            layouts, plan, *numbers = write_plan_times(arrays, mesh, mode, n, p, prof)
            runs.append([None, None, *numbers])
        bpp = plan.bytes_per_process()
        emit(
            kind="write",
            processes=n,
            arrays=n_arrays,
            mode=mode,
            chosen=plan.mode,
            distinct_layouts=len({id(la) for la in layouts}),
            devices=n * DEVICES_PER_PROCESS,
            layouts_build_s=round(med(r[2] for r in runs), 3),
            cold_s=round(med(r[3] for r in runs), 4),
            cold_all_s=[round(r[3], 4) for r in runs],
            cached_s=round(med(r[4] for r in runs), 6),
            process_items_s=round(med(r[5] for r in runs), 4),
            my_boxes=runs[-1][6],
            chunks_total=int(sum(len(a.writer) for a in plan.arrays)),
            plan_mb=round(plan_nbytes(plan) / 1e6, 1),
            imbalance=round(float(bpp.max() / bpp.mean()), 4),
            manifest_gb=round(manifest_estimate(plan, n) / 1e9, 2),
        )
        if mode == "auto":
            chunks = [(a.starts, a.stops, a.nbytes) for a in plan.arrays]
            reshard = Mesh(dp, 2 * (n // dp), DEVICES_PER_PROCESS // 2)
            for name, tl in (("same", layouts), ("reshard", build_layouts(arrays, reshard))):
                tb = [target_boxes(la, p) for la in tl]
                results = []
                for _ in range(repeat):
                    times = dict.fromkeys(("setup_s", "plan_s"), 0.0)
                    reads, _ = timed(
                        lambda t=times, tl=tl, pl=plan, la=layouts: read_plan(pl, la, p, tl, t),
                        prof,
                    )
                    results.append((times["plan_s"], times))
                total, times = sorted(results, key=lambda x: x[0])[len(results) // 2]
                looked, pairs = scanned(chunks, tb)
                emit(
                    kind="read",
                    processes=n,
                    arrays=n_arrays,
                    target=name,
                    total_s=round(total, 4),
                    total_all_s=[round(r[0], 4) for r in results],
                    reads=reads,
                    target_boxes=int(sum(len(s) for s, _ in tb)),
                    chunks_scanned=looked,
                    all_pairs=pairs,
                    **{k: round(v, 4) for k, v in times.items()},
                )
        del plan, layouts, runs
        gc.collect()
    if prof is not None:
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(20)
        st.sort_stats("cumulative").print_stats(25)
        print(f"\n## cProfile, {n:,} processes (write plans of every mode + read plans)\n")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))


def table(rows: list[dict]) -> None:
    write = [r for r in rows if r["kind"] == "write"]
    read = [r for r in rows if r["kind"] == "read"]
    print("\n## Write plan of one process (seconds)\n")
    print(
        "| processes | devices | arrays (layouts) | mode | cold | cached | process_items | total chunks "
        "| plan MB | max/mean | manifest GB (est.) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in write:
        mode = r["mode"] if r["mode"] != "auto" else f"auto ({r['chosen']})"
        print(
            f"| {r['processes']:,} | {r['devices']:,} | {r['arrays']} ({r['distinct_layouts']}) "
            f"| {mode} | {r['cold_s']:.3f} | {r['cached_s']:.6f} | {r['process_items_s']:.3f} "
            f"| {r['chunks_total']:,} | {r['plan_mb']:.0f} | {r['imbalance']:.3f} "
            f"| {r['manifest_gb']:.2f} |"
        )
    print("\n## Read plan of one process (seconds)\n")
    print(
        "| processes | target | read plan | target boxes "
        "| reads | chunks scanned / all box x chunk pairs |"
    )
    print("|---|---|---|---|---|---|")
    for r in read:
        print(
            f"| {r['processes']:,} | {r['target']} | {r['total_s']:.3f} "
            f"| {r['target_boxes']:,} | {r['reads']:,} "
            f"| {r['chunks_scanned']:,} / {r['all_pairs']:,} ({r['chunks_scanned'] / max(r['all_pairs'], 1):.2e}) |"
        )
    # growth: time per process relative to the smallest run, against the process count
    ns = sorted({r["processes"] for r in write})
    if len(ns) > 1:
        print("\n## Growth against the process count (time ratio / process-count ratio)\n")
        base = ns[0]
        for label, rs, key in (
            ("write plan, auto, cold", [r for r in write if r["mode"] == "auto"], "cold_s"),
            ("read plan, same mesh", [r for r in read if r["target"] == "same"], "total_s"),
            ("read plan, reshard", [r for r in read if r["target"] == "reshard"], "total_s"),
        ):
            t = {r["processes"]: r[key] for r in rs}
            if base in t:
                parts = [f"{n:,}: {t[n] / t[base] / (n / base):.2f}" for n in ns if n in t]
                print(
                    f"- {label}: "
                    + ", ".join(parts)
                    + "  (1.00 = linear; above 1 = faster than linear)"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--processes", default="1000,4000,10000")
    ap.add_argument("--arrays", type=int, default=2000)
    ap.add_argument("--modes", default="auto,balanced,replica_parallel,single_replica")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel replica groups")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest size")
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    args = ap.parse_args()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"planning-{stamp}.jsonl")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    rows: list[dict] = []
    ns = [int(x) for x in args.processes.split(",")]
    with open(out_path, "a") as out:

        def emit(**kw):
            rows.append(kw)
            out.write(json.dumps(kw) + "\n")
            out.flush()
            print(json.dumps(kw), flush=True)

        for n in ns:
            bench_one(
                n,
                args.arrays,
                args.modes.split(","),
                args.dp,
                args.repeat,
                args.profile and n == max(ns),
                emit,
            )
    table(rows)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\npeak RSS of the bench: {peak:.0f} MB; load average {os.getloadavg()}; results: {out_path}"
    )


if __name__ == "__main__":
    main()
