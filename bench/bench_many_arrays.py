"""Save and restore of a state of many small arrays, where the cost per array, not the bytes,
sets the time: snapshard.torch against torch.distributed.checkpoint (DCP), and snapshard
against Orbax and against the floors, on the same arrays, at one or several sizes.

Each round runs one fresh job per library (bench/job_many_arrays.py), in an order rotated
by the round. A job makes N float32 arrays, then saves (durable: fsync'd) and restores them
`--repeats` + 1 times; the first of each is reported apart (what a restart pays: imports,
thread pools, first allocations), the others as their median. Restores go into
preallocated targets (torch: `empty_like` tensors in place; JAX: ShapeDtypeStructs on the
arrays' sharding) and are checked bit-exact. Every operation's memory is its peak RSS over
the RSS before it (the kernel's high-water mark reset through /proc/self/clear_refs, else
RSS sampled every 2 ms: the tables say which), the largest of the measured repeats,
against the bytes the state occupies in the process (on CPU devices a replicated array is
in memory once per device).

    python bench/bench_many_arrays.py --rounds 3 [--arrays 1000] [--repeats 3]

Without `--mesh`: N arrays of `--side` x `--side` (default 1000 of 64 x 64, 16 MiB; a model's
norms, biases and small projections, times the optimizer's moments), the four libraries.
With `--mesh D`, the JAX side on D CPU devices per process, the layout of a sharded
training state: arrays of `--side` x 16 float32, every other one sharded over every device
of the job on its first axis, the others replicated. snapshard and Orbax run beside the
floors measured in the same run, in a job of their own: for a save, one batched
`jax.device_get` of every array (with several processes, of the shards of replica 0 a
process holds) plus one fsync'd write of the same bytes (`save_floor`); for a restore, one
read of a file holding the slices a process's devices need and one
`make_array_from_callback` per array (`load_floor`), and (one process) one batched
`jax.device_put` of the host arrays onto their shardings. snapshard's `save_async` is
timed up to its return (`async_block`), against the batched `device_get`, and (one process
on CPU, for reference) against a host view of every shard a writer needs, one
`np.asarray` each (`shard_views`: the least any library does through JAX's API).

Every operation that reads the state (a save, `save_async`, the `device_get`s) is given new
arrays of the same values first, untimed, as a training loop's save is: JAX keeps the host
copy of a sharded array once fetched, and a `device_get` of the same arrays again costs a
tenth of the first (measured: 0.08 against 0.75-0.93 s for 10,000 arrays).

    python bench/bench_many_arrays.py --mesh 8 --arrays 1000,10000,100000 --orbax-max 10000 \\
        --rounds 2 --repeats 1
    python bench/bench_many_arrays.py --mesh 4 --processes 2 --arrays 1000,10000
    python bench/bench_many_arrays.py --mesh 8 --arrays 10000 --mix

`--arrays` takes a list: every size runs in the same invocation, and a growth table says
the cost per array at each size and its ratio from the smallest to the largest (1: linear).
`--processes P` (with `--mesh`): P real processes per job (jax.distributed on 127.0.0.1,
gloo), one mesh over every device of the job; each process measures its own operations
after a barrier, a job's time is its slowest process's, its memory its largest.
`--accelerator` (with `--mesh 1`): the JAX side on the accelerator's devices, where
`device_get` and `make_array_from_callback` move bytes between host and device memory.
`--mix` adds four arrays of 16, 32, 48 and 64 MiB (sharded) beside the small ones, so that
bytes count too. `--orbax-max N` leaves Orbax out above N arrays (at 100,000 it takes too
long). The last table lists the issue's targets at 10,000 arrays and more and whether each
is met.

Prints medians over rounds and the ratios peer / snapshard paired per round; writes the
results as JSON lines (--out, default bench/results/many-arrays-<time>.jsonl).
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

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARIES = ("snap_torch", "dcp", "snap_jax", "orbax")
MESH_LIBRARIES = ("snap_jax", "orbax", "floor")
OPS = ("save", "load", "async_block", "device_get", "device_put", "shard_views")
TARGET_FROM = 10_000  # the targets hold at 10,000 arrays and more


# ---------------------------------------------------------------- running the jobs
def _job_cmd(lib: str, n: int, args: argparse.Namespace, pid: int, port: int) -> list[str]:
    cmd = [sys.executable, os.path.join(HERE, "job_many_arrays.py"), "--lib", lib,
           "--arrays", str(n), "--side", str(args.side), "--repeats", str(args.repeats),
           "--mesh", str(args.mesh), "--processes", str(args.processes),
           "--process-id", str(pid), "--port", str(port)]  # fmt: skip
    return [*cmd, "--mix"] if args.mix else cmd


def _run(lib: str, n: int, args: argparse.Namespace, logs: str) -> dict[str, Any]:
    """One job: its processes started together, bounded by --timeout, none left behind."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
    if not args.accelerator:
        env["JAX_PLATFORMS"] = "cpu"
    if args.library:  # ahead of what the environment's PYTHONPATH names (JAX's, on a TPU host)
        env["PYTHONPATH"] = os.pathsep.join(
            x for x in (args.library, os.environ.get("PYTHONPATH")) if x
        )
    if args.mesh and not args.accelerator:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.mesh}"
    port = bc.free_port() if args.processes > 1 else 0  # (a TPU host opens no sockets)
    procs, errs = [], []
    for pid in range(args.processes):
        err = open(os.path.join(logs, f"{lib}-{n}-{pid}.err"), "w+")  # noqa: SIM115
        errs.append(err)
        procs.append(subprocess.Popen(_job_cmd(lib, n, args, pid, port), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=err, start_new_session=True))  # fmt: skip
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.timeout
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results += [json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")]
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{lib} at {n} arrays: over --timeout {args.timeout} s") from None
    finally:
        for p in procs:  # however the job ended, none of its processes survive it
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        tails = []
        for e in errs:
            e.seek(0)
            tails.append(e.read()[-3000:])
            e.close()
    if len(results) != args.processes:
        raise RuntimeError(f"{lib} at {n} arrays failed:\n" + "\n".join(tails))
    return _merge(results)


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's figures from its processes': per repeat the slowest process's time and
    the largest memory; then the first repeat apart and the median (memory: the largest)
    of the others."""
    first = results[0]
    row: dict[str, Any] = {
        k: first[k]
        for k in (
            "lib",
            "arrays",
            "side",
            "mesh",
            "mix",
            "processes",
            "state_B",
            "resident_B",
            "memory_method",
        )
    }
    row.update({k: first[k] for k in ("devices", "device_kind") if k in first})
    row["exact"] = all(r["exact"] for r in results)
    for op in OPS:
        if f"{op}_s" not in first:
            continue
        times = [max(x) for x in zip(*(r[f"{op}_s"] for r in results), strict=True)]
        mems = [max(x) for x in zip(*(r[f"{op}_mem_B"] for r in results), strict=True)]
        row[f"first_{op}_s"] = times[0]
        row[f"{op}_s"] = statistics.median(times[1:] or times)
        row[f"{op}_mem_B"] = max(mems[1:] or mems)
    return row


# ---------------------------------------------------------------- the tables
def _by(rows: list[dict[str, Any]], lib: str) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["lib"] == lib), key=lambda r: r["round"])


def _paired(a: list[dict[str, Any]], ka: str, b: list[dict[str, Any]], kb: str) -> list[float]:
    """a[ka] / b[kb], round by round (rounds where either is missing left out)."""
    rb = {r["round"]: r for r in b}
    return [
        x[ka] / rb[x["round"]][kb]
        for x in a
        if x["round"] in rb and ka in x and kb in rb[x["round"]]
    ]


def _mem(rows: list[dict[str, Any]], op: str) -> list[float]:
    return [r[f"{op}_mem_B"] / r["resident_B"] for r in rows if f"{op}_mem_B" in r]


def _size_table(rows: list[dict[str, Any]], libs: tuple[str, ...]) -> None:
    r0 = rows[0]
    n, side, mesh, procs = r0["arrays"], r0["side"], r0["mesh"], r0["processes"]
    what = (
        f"{side}x16 float32 on {procs} x {r0.get('devices', mesh) // procs} "  # devices: global
        f"{r0.get('device_kind', 'CPU')} "
        "device(s) (half sharded, half replicated)"
        if mesh
        else f"{side}x{side} float32"
    )
    mix = ", with 4 arrays of 16-64 MiB" if r0["mix"] else ""
    print(f"\n## {n} arrays of {what}{mix}: {r0['state_B'] / 2**20:.1f} MiB, medians over rounds\n")
    print(
        "| library | first save | first restore | save | restore | save memory / state | restore memory / state | bit-exact |"
    )
    print("|---|---|---|---|---|---|---|---|")
    keys = ("first_save_s", "first_load_s", "save_s", "load_s")
    for lib in libs:
        rs = _by(rows, lib)
        if rs:
            cells = [bc.spread([r[k] for r in rs], 3) for k in keys]
            cells += [bc.spread(_mem(rs, "save")), bc.spread(_mem(rs, "load"))]
            print(f"| {lib} | " + " | ".join(cells) + f" | {all(r['exact'] for r in rs)} |")
    how = "kernel high-water mark" if r0["memory_method"] == "hwm" else "RSS sampled every 2 ms"
    print(f"\n(memory: the largest process's peak RSS over its RSS before the operation, over the "
          f"{r0['resident_B'] / 2**20:.1f} MiB the state occupies in a process, a replicated array "
          f"once per device; {how})")  # fmt: skip
    floor, ours = _by(rows, "floor"), _by(rows, "snap_jax")
    if floor and ours:
        put = [r["device_put_s"] for r in floor if "device_put_s" in r]
        views = [r["shard_views_s"] for r in floor if "shard_views_s" in r]
        print(f"\nbatched device_put {bc.spread(put, 3)} s, "
              f"batched device_get {bc.spread([r['device_get_s'] for r in floor], 3)} s, "
              f"snapshard save_async blocking {bc.spread([r['async_block_s'] for r in ours], 3)} s"
              + (f"; host views of the shards a writer needs (below JAX's API) "
                 f"{bc.spread(views, 3)} s" if views else ""))  # fmt: skip


def _checks(rows: list[dict[str, Any]]) -> list[tuple[str, list[float], str]]:
    """The issue's ratios of one size, with their targets."""
    ours, floor, orbax = _by(rows, "snap_jax"), _by(rows, "floor"), _by(rows, "orbax")
    torch, dcp = _by(rows, "snap_torch"), _by(rows, "dcp")
    checks = []
    if floor:
        checks += [
            ("snapshard save / floor", _paired(ours, "save_s", floor, "save_s"), "<= 2"),
            ("snapshard restore / floor", _paired(ours, "load_s", floor, "load_s"), "<= 2"),
            ("snapshard restore / batched device_put", _paired(ours, "load_s", floor, "device_put_s"), ""),
            ("save_async blocking / batched device_get", _paired(ours, "async_block_s", floor, "device_get_s"), "<= 1.5"),
            ("save_async blocking / host views of the shards", _paired(ours, "async_block_s", floor, "shard_views_s"), ""),
        ]  # fmt: skip
    if orbax:
        checks += [
            ("orbax / snapshard, save", _paired(orbax, "save_s", ours, "save_s"), ">= 5"),
            ("orbax / snapshard, restore", _paired(orbax, "load_s", ours, "load_s"), ">= 5"),
        ]
    if dcp:
        checks += [
            ("dcp / snapshard.torch, save", _paired(dcp, "save_s", torch, "save_s"), ">= 1.5"),
            ("dcp / snapshard.torch, restore", _paired(dcp, "load_s", torch, "load_s"), ">= 1.5"),
        ]
    for lib, rs in (("snapshard", ours), ("snapshard.torch", torch)):
        if rs:
            checks += [
                (f"{lib} save memory / state", _mem(rs, "save"), "<= 1.2"),
                (f"{lib} restore memory / state", _mem(rs, "load"), "<= 1.2"),
            ]
    return checks


def _growth(rows: list[dict[str, Any]], sizes: list[int], libs: tuple[str, ...]) -> None:
    lo, hi = sizes[0], sizes[-1]
    print(
        f"\n## Growth: µs per array (median time / arrays) at each size, and the ratio {hi} / {lo} (1: linear)\n"
    )
    print("| library, operation | " + " | ".join(f"at {n}" for n in sizes) + f" | {hi} / {lo} |")
    print("|---" * (len(sizes) + 2) + "|")
    for lib in libs:
        for op in OPS:
            per = []
            for n in sizes:
                v = [
                    r[f"{op}_s"]
                    for r in rows
                    if r["lib"] == lib and r["arrays"] == n and f"{op}_s" in r
                ]
                per.append(statistics.median(v) / n * 1e6 if v else None)
            if all(x is None for x in per):
                continue
            cells = ["-" if x is None else f"{x:.1f}" for x in per]
            ratio = f"{per[-1] / per[0]:.2f}" if per[0] and per[-1] else "-"
            print(f"| {lib} {op} | " + " | ".join(cells) + f" | {ratio} |")


def _targets(rows: list[dict[str, Any]], sizes: list[int]) -> None:
    big = [n for n in sizes if n >= TARGET_FROM]
    if not big:
        return
    print(
        f"\n## The targets at {TARGET_FROM} arrays and more (medians of the ratios paired per round)\n"
    )
    print("| arrays | ratio | value | target | met |")
    print("|---|---|---|---|---|")
    for n in big:
        for name, v, target in _checks([r for r in rows if r["arrays"] == n]):
            if not target:
                continue
            if not v:
                print(f"| {n} | {name} | not measured | {target} | |")
                continue
            op, x = target.split()
            m = statistics.median(v)
            met = (m >= float(x)) if op == ">=" else (m <= float(x))
            print(f"| {n} | {name} | {bc.spread(v)} | {target} | {'yes' if met else 'NO'} |")


def report(rows: list[dict[str, Any]], libs: tuple[str, ...]) -> None:
    sizes = sorted({r["arrays"] for r in rows})
    for n in sizes:
        at = [r for r in rows if r["arrays"] == n]
        _size_table(at, libs)
        bc.ratio_table(f"{n} arrays: ratios, paired by round", _checks(at))
    if len(sizes) > 1:
        _growth(rows, sizes, libs)
    _targets(rows, sizes)


# ---------------------------------------------------------------- main
def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--arrays", default="1000", help="sizes, comma-separated (e.g. 1000,10000,100000)"
    )
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mesh", type=int, default=0,
                    help="CPU devices per process for the JAX side's sharded layout (0: one device, torch too)")  # fmt: skip
    ap.add_argument("--processes", type=int, default=1, help="processes per job (with --mesh)")
    ap.add_argument("--accelerator", action="store_true",
                    help="the JAX side on the default backend's devices (a TPU, a GPU), all of "
                         "them, instead of --mesh CPU devices (with --mesh, any value > 0)")  # fmt: skip
    ap.add_argument("--mix", action="store_true", help="add 4 arrays of 16-64 MiB")
    ap.add_argument(
        "--orbax-max", type=int, default=None, metavar="N", help="no Orbax above N arrays"
    )
    ap.add_argument("--only", default=None, help="libraries to run, comma-separated")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    ap.add_argument("--at", default=None, metavar="REV", help="measure the library as of this git commit, not the working tree")  # fmt: skip
    ap.add_argument(
        "--analyze", default=None, metavar="FILE", help="reprint the tables of an earlier run"
    )
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    args = ap.parse_args()
    if args.processes > 1 and not args.mesh:
        ap.error("--processes needs --mesh (the torch wing runs in one process)")
    args.sizes = [int(x) for x in args.arrays.split(",") if x]
    return args


def main() -> None:
    args = _parse()
    every = MESH_LIBRARIES if args.mesh else LIBRARIES
    if args.analyze:
        with open(args.analyze) as f:
            report([json.loads(line) for line in f if line.strip()], every)
        return
    libs = [x for x in (args.only or ",".join(every)).split(",") if x]
    out = args.out or os.path.join(
        HERE, "results", f"many-arrays-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.library = bc.library_at(args.at, tmp) if args.at else None
        for n in args.sizes:
            here = [
                x
                for x in libs
                if not (x == "orbax" and args.orbax_max is not None and n > args.orbax_max)
            ]
            for r in range(args.rounds):
                for lib in here[r % len(here) :] + here[: r % len(here)]:
                    row = _run(lib, n, args, tmp) | {"round": r}
                    rows.append(row)
                    with open(out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"{n} arrays, round {r}, {lib}: save {row['save_s']:.3f} s, "
                          f"load {row['load_s']:.3f} s", flush=True)  # fmt: skip
    report(rows, every)


if __name__ == "__main__":
    main()
