"""The shape of MLPerf Storage's checkpointing workload for llama3-8b: 8 processes, each
saving and restoring its ZeRO-3 shards of the model's parameters and AdamW state, 10
durable saves then 10 restores from a cold page cache, reported per operation as the
slowest process's time, the throughput it gives (all the bytes over it) and the lowest
throughput of any single process. snapshard.torch (direct and as DCP's storage) against
PyTorch DCP's own file storage, snapshard's JAX API against Orbax on the same state as
global jax.Arrays, and all of them against a raw write/read of the same bytes.

    python bench/bench_mlperf_shape.py                              # 8 processes, ~2.3 GB, 3 rounds
    python bench/bench_mlperf_shape.py --scale 0.001 --saves 3 --restores 3 --rounds 1
    python bench/bench_mlperf_shape.py --scale 1                    # llama3-8b in full: 112 GB
    python bench/bench_mlperf_shape.py --methods raw,dcp,orbax,snapshard-jax
    python bench/bench_mlperf_shape.py --analyze bench/results/mlperf-<time>.jsonl

The state (bench/job_mlperf.py): llama3-8b's parameters (vocab 128256, dim 4096, 32 layers,
32 heads, 8 kv heads, ffn hidden 14336: token embeddings; per layer wq, wk, wv, wo, w1, w2,
w3 and the two RMSNorm weights; final norm; output), each as a bf16 parameter plus AdamW's
fp32 master weight, exp_avg and exp_avg_sq (14 B per parameter: 112,423,657,472 B in full),
every tensor flattened to 1-D and cut over all the processes as a DTensor with Shard(0) on
a 1-D device mesh (`init_device_mesh("cpu", (world,))`), as ZeRO-3 / FSDP1 shard flat
parameters: each process holds 1/world of every tensor and nothing is replicated.
`--scale S` takes about S times the full bytes: first fewer layers (the nearest count),
then, below one full-width layer, one layer with every width shrunk together (the head dim
of 1-128, which sets dim, kv dim, ffn hidden and vocab in llama3-8b's proportions); the
run prints the shape and its exact bytes. Values are seeded per tensor, role and process,
and the low mantissa bits of every element are XORed with a key of the save before each
save, so no save writes bytes an earlier one wrote (keys repeat after 127 saves; the JAX
job draws its values with NumPy: the same distributions, other values).

One job per method and round: `--procs` (8) fresh processes, bounded by `--timeout` (each
process its own session; all of them killed with their process groups when one fails or
the time is up): for the torch methods, bench/job_mlperf.py, gloo on CPU, meeting through
env:// on 127.0.0.1 at a free port; for the JAX methods, bench/job_mlperf_jax.py, meeting
through jax.distributed.initialize at that address (one CPU device per process, the
same tensors as 1-D jax.Arrays with NamedSharding(P("x")) over a 1-D mesh of every
process's device; JAX cuts only evenly, which 1, 2, 4 and 8 processes always do). Methods
run in an order rotated by the round. A job first saves and restores the norm tensors
once, unrecorded, then
  `--saves` (10) saves, each into a new checkpoint, the previous one removed first and the
    machine's dirty pages flushed (os.sync), untimed; each durable: raw fsyncs its file and
    directory, snapshard fsyncs its files and directories itself, DCP's FileSystemWriter
    fsyncs its files (sync_files=True) and the job fsyncs its directories inside the time,
    Orbax's TensorStore fsyncs its data files and their directories and the job fsyncs the
    rest (Orbax's own metadata files, its renamed directory) inside the time;
  `--restores` (10) restores of the last checkpoint, each into a new zero-filled target of
    the save layout (allocated and touched before the clock; the JAX methods restore into
    an abstract target of the save's sharding and allocate inside the call, as JAX
    restores do, timed up to block_until_ready), after every file of the
    checkpoint was fsync'd and dropped from the page cache with
    posix_fadvise(POSIX_FADV_DONTNEED) (a hypervisor below may still cache the blocks);
    every restore is checked byte for byte, on every process, against the state saved.
With `--raw-beside` (the default; `--no-raw-beside` turns it off) snapshard's jobs also
run the raw write (read) of the same processes' bytes right beside each save (restore),
alternating which goes first (job_mlperf.RawBeside): the ratio to raw is then paired per
operation, in the same processes, seconds apart, where the raw job's figures come from
another job minutes apart, on a disk whose speed drifts by 2x over minutes here.
Each operation: a barrier, then each process times its own call. As MLPerf reports it, an
operation's time is its slowest process's, its throughput is the state's bytes over that
time, and its lowest single-process throughput is the least of each process's own bytes
over its own time (with shards of equal size, as with 1, 2, 4 or 8 processes at any scale,
that is the throughput over the number of processes; it tells more where they differ). GB/s are 10^9
bytes per second.

Methods:
  raw            each process writes the bytes of its shards into one file (os.write, then
                 os.fsync of the file and its directory) and reads them back with os.readv
                 straight into the target's tensors: the floor of the disk
  snapshard      snapshard.torch.save(path, state) / snapshard.torch.load(path, target)
  dcp            torch.distributed.checkpoint save / load with FileSystemWriter /
                 FileSystemReader (their defaults: one file per process, one thread)
  dcp+snapshard  dcp.save / dcp.load with snapshard.torch.StorageWriter / StorageReader
  orbax          orbax.checkpoint.StandardCheckpointer: save then wait_until_finished (the
                 checkpoint committed on every process), restore into the abstract target;
                 Orbax's defaults, so its arrays are zstd-compressed (see "on disk / state")
  snapshard-jax  snapshard.save(path, state) / snapshard.load(path, abstract target)

Tables: medians with [min-max] over every save (restore) of every round; ratios against
`raw`, `dcp` and `orbax` paired per round (a method's median of the round over the
other's median of the same round, then the median [min-max] of those over the rounds);
against the raw operation beside each (--raw-beside), per operation; and
the targets for snapshard's figures (`snapshard`, `dcp+snapshard` and `snapshard-jax`):
save and restore throughput, and the lowest single-process throughput, each >= 0.9x raw
and ahead of DCP and of Orbax.

Memory: the state and one target, about twice the state over all processes (the JAX job:
three times, its host copy, its arrays and the restored arrays), plus each process's
interpreter and torch or JAX and Orbax (~0.35-0.5 GB). Disk: at most two checkpoints (the
last save and the one being written). Checkpoints go under $SNAPSHARD_BENCH_DIR (default a
folder in the temp dir) and are deleted after every job. Writes one JSON line per job
(--out, default bench/results/mlperf-<time>.jsonl).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc
from job_mlperf import FULL_BYTES
from job_mlperf import METHODS as TORCH_METHODS
from job_mlperf_jax import METHODS as JAX_METHODS

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9
METHODS = TORCH_METHODS + JAX_METHODS
SNAPSHARD = ("snapshard", "dcp+snapshard", "snapshard-jax")
BASES = ("raw", "dcp", "orbax")  # what snapshard's figures are paired against
RAW_TARGET = 0.9  # snapshard's throughput against raw's


# ---------------------------------------------------------------- running the jobs
def run_job(method: str, r: int, args: argparse.Namespace, root: str) -> dict[str, Any]:
    """One method's job on --procs fresh processes: its RESULT with the run's settings, or
    a row naming why it gave none. No process of it survives it."""
    head = {"round": r, "method": method, "procs": args.procs, "scale": args.scale,
            "saves": args.saves, "restores": args.restores}  # fmt: skip
    path = os.path.join(root, method.replace("+", "-"))
    port = bc.free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(args.procs), "LOCAL_WORLD_SIZE": str(args.procs),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    job = "job_mlperf_jax.py" if method in JAX_METHODS else "job_mlperf.py"
    cmd = [sys.executable, os.path.join(HERE, job), "--method", method,
           "--scale", str(args.scale), "--saves", str(args.saves),
           "--restores", str(args.restores), "--dir", path, "--timeout", str(args.timeout)]  # fmt: skip
    if args.raw_beside and method in SNAPSHARD:
        cmd.append("--raw-beside")
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(args.procs)]
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(args.procs)]
        procs: list[subprocess.Popen[str]] = []
        why = ""
        try:
            for rank in range(args.procs):
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=outs[rank], stderr=errs[rank], text=True,
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        start_new_session=True,
                    )
                )  # fmt: skip
            deadline = time.monotonic() + args.timeout
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                if any(c for c in codes):  # one failed: the others would wait for it
                    why = f"a process exited {next(c for c in codes if c)}"
                    break
                if time.monotonic() > deadline:
                    why = f"over --timeout {args.timeout:.0f} s"
                    break
                time.sleep(0.2)
        finally:
            for p in procs:  # a process still running: its session, before it is reaped
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            bc.remove(path)
        outs[0].seek(0)
        rows = [json.loads(x[7:]) for x in outs[0] if x.startswith("RESULT ")]
        if rows and not why:
            return {**head, **rows[0], "job_s": round(time.perf_counter() - t0, 1),
                    "loadavg": [load0, os.getloadavg()[0]]}  # fmt: skip
        tails = {}  # the last lines of each process's stderr
        for rank, (p, e) in enumerate(zip(procs, errs, strict=False)):
            e.seek(0)
            lines = [x.rstrip() for x in e if x.strip()]
            if lines:
                tails[rank] = f"rank {rank} (exit {p.returncode}): " + " | ".join(lines[-3:])
    codes = [p.returncode for p in procs]
    # Those of the processes that failed by themselves (not killed here), else the first.
    shown = [r for r in tails if codes[r] not in (0, -signal.SIGKILL)] or list(tails)[:1]
    detail = " / ".join(tails[r] for r in shown)
    return {**head, "error": f"{why or 'no result'}; exit codes {codes}; {detail}"[:2000]}


# ---------------------------------------------------------------- the figures
def per_op(row: dict[str, Any], op: str, prefix: str = "") -> list[dict[str, float]]:
    """Each save (restore) of a job: the slowest process's seconds, the throughput (the
    state's bytes over them) and the lowest single-process throughput, in GB/s; with
    prefix "raw_", those of the raw operations beside them (--raw-beside)."""
    out = []
    for times in row.get(f"{prefix}{op}_s", []):
        slowest = max(times)
        lowest = min(b / t for b, t in zip(row["rank_B"], times, strict=True) if t > 0)
        out.append({"s": slowest, "gbps": row["total_B"] / slowest / GB, "low": lowest / GB})
    return out


def _ok(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "error" not in r]


def _by_method(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in _ok(rows):
        out.setdefault(r["method"], []).append(r)
    return {m: out[m] for m in METHODS if m in out}


def _round_medians(rows: list[dict[str, Any]], op: str, key: str) -> dict[tuple[str, int], float]:
    """(method, round) -> the median of `key` over that job's operations."""
    return {
        (r["method"], r["round"]): statistics.median(x[key] for x in per_op(r, op))
        for r in _ok(rows)
        if r[f"{op}_s"]
    }


def paired(rows: list[dict[str, Any]], op: str, key: str, a: str, b: str) -> list[float]:
    """a's median of a round over b's median of the same round, for every round both ran."""
    med = _round_medians(rows, op, key)
    return [v / med[(b, rd)] for (m, rd), v in sorted(med.items()) if m == a and (b, rd) in med]


def beside(rows: list[dict[str, Any]], op: str, key: str, m: str) -> list[float]:
    """m's operations over the raw ones beside them in the same job (--raw-beside), one
    ratio per operation, over every round."""
    out = []
    for r in _ok(rows):
        if r["method"] == m:
            pairs = zip(per_op(r, op), per_op(r, op, "raw_"), strict=False)
            out += [a[key] / b[key] for a, b in pairs]
    return out


def report(rows: list[dict[str, Any]]) -> None:
    good = _ok(rows)
    if not good:
        print("\nno job gave a result")
    else:
        one = good[0]
        c = one["cfg"]
        n_params = one["total_B"] // 14
        print(
            f"\nllama3-8b's shape at --scale {one['scale']}: {c['layers']} layer(s) of 32, "
            f"head dim {c['head_dim']} of 128 (dim {c['dim']}, kv dim {c['kv_dim']}, ffn "
            f"{c['ffn']}, vocab {c['vocab']}); {n_params:,} parameters x 14 B (bf16 param, "
            f"fp32 master, exp_avg, exp_avg_sq) = {one['total_B']:,} B "
            f"({one['total_B'] / 2**30:.2f} GiB, {one['total_B'] / FULL_BYTES:.5f} of the "
            f"full {FULL_BYTES:,} B); {one['procs']} processes of ~"
            f"{max(one['rank_B']) / 2**20:.1f} MiB; {one['saves']} saves and "
            f"{one['restores']} restores per job; {len({r['round'] for r in rows})} round(s)"
        )
        rss = max(max(r["peak_rss_B"]) for r in good)
        print(f"peak RSS of a process: {rss / 2**20:.0f} MiB")
    by = _by_method(rows)
    for op, title in (
        ("save", "Saves: durable, one new checkpoint each"),
        ("restore", "Restores: new target of the save layout, page cache dropped first"),
    ):
        print(f"\n## {title} (median [min-max] over every {op} of every round)\n")
        print(
            "| method | slowest process s | throughput GB/s | lowest process GB/s | "
            "throughput / raw | lowest process / raw | throughput / raw beside | "
            "throughput / dcp | throughput / orbax | "
            + ("on disk / state |" if op == "save" else "bit-exact |")
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for m, rs in by.items():
            xs = [x for r in rs for x in per_op(r, op)]
            if not xs:
                continue
            cells = [bc.spread([x[k] for x in xs], 3) for k in ("s", "gbps", "low")]
            for key, base in (("gbps", "raw"), ("low", "raw"), ("gbps", "beside"),
                              ("gbps", "dcp"), ("gbps", "orbax")):  # fmt: skip
                if base == "beside":
                    v = beside(rows, op, key, m)
                else:
                    v = paired(rows, op, key, m, base) if m != base else []
                cells.append(bc.spread(v) if v else "")
            if op == "save":
                last = [r["on_disk_B"] / r["total_B"] for r in rs if r["on_disk_B"]]
                cells.append(bc.spread(last, 4) if last else "")
            else:
                ok = all(all(r["restore_exact"]) and r["warmup_exact"] for r in rs)
                cells.append("yes" if ok else "NO")
            print(f"| {m} | " + " | ".join(cells) + " |")
    for r in rows:
        if "error" in r:
            print(f"\nround {r['round']}, {r['method']}: failed: {r['error']}")

    print(
        "\n## Targets: snapshard's figures, paired per round (median [min-max] over the "
        "rounds), and against the raw operation beside each (median [min-max] over the "
        "operations)\n"
    )
    print("| figure | value | target | met |")
    print("|---|---|---|---|")
    for m in SNAPSHARD:
        if m not in by:
            continue
        for op in ("save", "restore"):
            for key, what in (("gbps", "throughput"), ("low", "lowest process throughput")):
                for base in ("raw beside", *BASES):
                    raw = base.startswith("raw")
                    target = RAW_TARGET if raw else 1.0
                    v = (
                        beside(rows, op, key, m)
                        if base == "raw beside"
                        else paired(rows, op, key, m, base)
                    )
                    if not v:
                        continue
                    med = statistics.median(v)
                    met = med >= target if raw else med > target
                    sign = ">=" if raw else ">"
                    print(
                        f"| {m} {op} {what} / {base} | {bc.spread(v)} | {sign} {target:g} | "
                        f"{'yes' if met else 'NO'} |"
                    )


# ---------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.02, help="of llama3-8b's 112 GB state")
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--restores", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    ap.add_argument("--timeout", type=float, default=3600, help="per job, seconds")
    ap.add_argument(
        "--raw-beside", action=argparse.BooleanOptionalAction, default=True,
        help="snapshard's jobs also time the raw write (read) beside each save (restore)",
    )  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument(
        "--analyze", default=None, metavar="FILE", help="reprint the tables of an earlier run"
    )
    args = ap.parse_args()
    if args.analyze:
        with open(args.analyze) as f:
            report([json.loads(x) for x in f if x.strip()])
        return
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; known: {', '.join(METHODS)}")
    if args.procs < 1 or args.saves < 1 or args.restores < 0:
        raise SystemExit("--procs and --saves must be at least 1, --restores at least 0")
    from job_mlperf import shape_for, state_bytes

    total = state_bytes(shape_for(args.scale))
    out = args.out or os.path.join(
        HERE, "results", f"mlperf-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    root = bc.ckpt_dir("mlperf")
    print(f"{total:,} B over {args.procs} processes; results: {out}; checkpoints under {root}")
    rows = []
    try:
        for r in range(args.rounds):
            k = r % len(methods)
            for m in methods[k:] + methods[:k]:
                bc.settle()
                row = run_job(m, r, args, root)
                rows.append(row)
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                state = row.get("error") or (
                    f"save {statistics.median(x['gbps'] for x in per_op(row, 'save')):.3f} GB/s"
                    + (
                        f", restore {statistics.median(x['gbps'] for x in per_op(row, 'restore')):.3f} GB/s"
                        if row["restore_s"]
                        else ""
                    )
                    + f" ({row['job_s']} s)"
                )
                print(f"round {r} {m}: {state}", flush=True)
    finally:
        bc.remove(root)
    report(rows)


if __name__ == "__main__":
    main()
