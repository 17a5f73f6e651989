"""The `snapshard` command on checkpoints of many leaves: `ls`, `info`, `verify` and `diff`,
each in a fresh process (what a user at a terminal pays), at 1,000 / 10,000 / 100,000 leaves.

For each size a fresh process saves two steps of a run: A, and B with 1% of its arrays
changed in value and one array more. Then every command runs `--repeats` times in a fresh
process, in an order rotated by the repeat, next to its floors measured the same way: the
interpreter and the CLI's import (`import`), and the read of A's manifest alone
(`manifest`: parsed and validated, format.reading.read_checkpoint), which every command but
`ls` of a directory pays before it does its own work. With `--baseline REV` each command
also runs with the library as of git commit REV (put first on PYTHONPATH), paired per
repeat: the figures before and after a change, side by side; `--at REV` measures the
library as of REV instead of the working tree.

    python bench/bench_cli.py --leaves 1000,10000,100000 --repeats 3
    python bench/bench_cli.py --leaves 100000 --repeats 3 --baseline HEAD~3
    python bench/bench_cli.py --leaves 10000 --kind mesh   # 8 CPU devices, half sharded

`--kind numpy` (default): arrays of 16 float32 on the host. `--kind mesh`: 64x16 float32
jax.Arrays on 8 CPU devices, every other one sharded over the 8 devices (8 chunks), the
others replicated. Prints medians (wall and CPU seconds of the command's process), output
lines, the cost per leaf and its growth from the smallest size to the largest, and the
ratios to the manifest's read and to the baseline in CPU seconds (on a shared machine the
wall clock counts the others' work too); writes JSON lines (--out, default
bench/results/cli-<time>.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHANGED_EVERY = 100  # B differs from A in the value of one array in 100

# name -> argv after `snapshard` ({run}: the run directory, {a} and {b}: its two steps)
COMMANDS: dict[str, list[str]] = {
    "ls": ["ls", "{run}"],
    "info": ["info", "{a}"],
    "info --json": ["info", "{a}", "--json"],
    "verify": ["verify", "{a}"],
    "diff": ["diff", "{a}", "{b}"],
    "diff --values": ["diff", "{a}", "{b}", "--values"],
}
CLI = "import sys; from snapshard.cli import main; sys.exit(main(sys.argv[1:]))"
FLOORS = {
    "import": "import snapshard.cli",
    "manifest": "import sys; from snapshard.storage import storage_for; "
    "from snapshard.format.reading import read_checkpoint; read_checkpoint(storage_for(sys.argv[1]))",
}


def _make_job(n: int, kind: str, run: str) -> None:
    """Save steps 1 (A) and 2 (B) of a run of `n` arrays, in this (fresh) process."""
    import numpy as np

    import snapshard

    rng = np.random.default_rng(0)
    if kind == "mesh":
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        mesh = Mesh(np.array(jax.devices()), ("d",))
        cut, whole = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
        host = [rng.standard_normal((64, 16), np.float32) for _ in range(n)]
        arrays = jax.device_put(host, [cut if i % 2 == 0 else whole for i in range(n)])
    else:
        arrays = [rng.standard_normal(16, np.float32) for _ in range(n)]
    a = {"layers": {f"{i:06d}": {"w": x} for i, x in enumerate(arrays)}, "step": 1}
    snapshard.save(os.path.join(run, "1"), a)
    b = {**a, "layers": dict(a["layers"]), "step": 2, "extra": np.zeros(4, np.float32)}
    for i in range(0, n, CHANGED_EVERY):
        b["layers"][f"{i:06d}"] = {"w": arrays[i] + 1}
    snapshard.save(os.path.join(run, "2"), b)


def _make(n: int, kind: str, run: str, pythonpath: str) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": pythonpath}
    if kind == "mesh":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    cmd = [sys.executable, __file__, "--make", str(n), "--kind", kind, "--into", run]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode:
        raise RuntimeError(f"making the {n}-leaf run failed:\n{p.stderr[-3000:]}")


def _timed(code: str, argv: list[str], pythonpath: str) -> dict[str, Any]:
    """One fresh process: wall and CPU seconds, exit code and lines printed."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "JAX_PLATFORMS": "cpu"}
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=1800
    )
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if p.returncode not in (0, 1):  # 1: diff found differences (as it should here)
        raise RuntimeError(f"{argv}: exit {p.returncode}\n{p.stderr[-2000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "rc": p.returncode, "lines": p.stdout.count("\n")}


def _one_size(n: int, args: argparse.Namespace, paths: dict[str, str]) -> list[dict[str, Any]]:
    run = os.path.join(bc.bench_dir(), "cli", f"run-{args.kind}-{n}")
    bc.fresh_dir(run)
    t = time.perf_counter()
    _make(n, args.kind, run, paths["now"])
    print(f"{n} leaves: made the run in {time.perf_counter() - t:.1f} s", flush=True)
    where = {"run": run, "a": os.path.join(run, "1"), "b": os.path.join(run, "2")}
    jobs: list[tuple[str, str, str, list[str]]] = []  # (name, version, code, argv)
    for name, code in FLOORS.items():
        jobs.append((name, "now", code, [where["a"]]))
    for name, argv in COMMANDS.items():
        if args.only and name not in args.only:
            continue
        filled = [a.format(**where) for a in argv]
        for version in paths:
            jobs.append((name, version, CLI, filled))
    rows = []
    for r in range(args.repeats):
        k = r % len(jobs)
        for name, version, code, argv in jobs[k:] + jobs[:k]:
            row = _timed(code, argv, paths[version])
            row.update(leaves=n, kind=args.kind, command=name, version=version, repeat=r)
            rows.append(row)
            print(f"  {name} ({version}): {row['wall_s']:.2f} s", flush=True)
    bc.remove(run)
    return rows


def _pick(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r[k] == x for k, x in match.items())]


def _med(rows: list[dict[str, Any]], key: str, **match: Any) -> float:
    v = [r[key] for r in _pick(rows, **match)]
    return statistics.median(v) if v else float("nan")


def _per_leaf_us(rows: list[dict[str, Any]], n: int, command: str) -> float:
    """A command's median CPU time above the interpreter's and the import's, per leaf (CPU,
    not wall: on a shared machine the wall clock also counts the others' work)."""
    start = _med(rows, "cpu_s", leaves=n, command="import")
    return (_med(rows, "cpu_s", leaves=n, command=command, version="now") - start) / n * 1e6


def _size_table(rows: list[dict[str, Any]], n: int, names: list[str], baseline: str | None) -> None:
    print(f"\n## {n} leaves ({rows[0]['kind']}), fresh processes, medians [min-max]\n")
    head = "| command | wall s | cpu s | lines printed | cpu µs per leaf above import | cpu / manifest's |"
    print(head + (f" {baseline}: wall s | {baseline} / now, cpu |" if baseline else ""))
    print("|---" * (6 + (2 if baseline else 0)) + "|")
    manifest = _med(rows, "cpu_s", leaves=n, command="manifest")
    for c in names:
        got = _pick(rows, leaves=n, command=c, version="now")
        if not got:
            continue
        cpu = _med(got, "cpu_s")
        cells = [c, bc.spread([r["wall_s"] for r in got]), f"{cpu:.2f}",
                 str(got[0]["lines"]), f"{_per_leaf_us(rows, n, c):.1f}", f"{cpu / manifest:.2f}"]  # fmt: skip
        old = _pick(rows, leaves=n, command=c, version="base")
        if baseline and old:  # paired by repeat, in CPU seconds
            ratios = [o["cpu_s"] / x["cpu_s"] for o, x in zip(old, got, strict=True)]
            cells += [bc.spread([o["wall_s"] for o in old]), bc.spread(ratios)]
        elif baseline:
            cells += ["", ""]
        print("| " + " | ".join(cells) + " |")


def _growth_table(rows: list[dict[str, Any]], sizes: list[int], names: list[str]) -> None:
    lo, hi = sizes[0], sizes[-1]
    print(
        f"\n## Growth: cpu µs per leaf above import, and its ratio {hi} / {lo} leaves (1: linear)\n"
    )
    print("| command | " + " | ".join(f"at {n}" for n in sizes) + f" | {hi} / {lo} |")
    print("|---" * (len(sizes) + 2) + "|")
    for c in names:
        if c == "import":
            continue
        per = [_per_leaf_us(rows, n, c) for n in sizes]
        cells = [f"{x:.1f}" for x in per] + [f"{per[-1] / per[0]:.2f}"]
        print(f"| {c} | " + " | ".join(cells) + " |")


def _report(rows: list[dict[str, Any]], baseline: str | None) -> None:
    sizes = sorted({r["leaves"] for r in rows})
    names = [*FLOORS, *(c for c in COMMANDS if _pick(rows, command=c))]
    for n in sizes:
        _size_table(rows, n, names, baseline)
    if len(sizes) > 1:
        _growth_table(rows, sizes, names)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--leaves", default="1000,10000,100000", help="sizes, comma-separated")
    ap.add_argument("--kind", choices=("numpy", "mesh"), default="numpy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--baseline", default=None, metavar="REV", help="also run the library as of this git commit"
    )
    ap.add_argument(
        "--at",
        default=None,
        metavar="REV",
        help="measure the library as of this git commit, not the working tree",
    )
    ap.add_argument(
        "--only", default=None, help="commands to run, comma-separated (names as printed)"
    )
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument("--make", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--into", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make is not None:
        _make_job(args.make, args.kind, args.into)
        return
    args.only = [x.strip() for x in args.only.split(",")] if args.only else None
    out = args.out or os.path.join(
        ROOT, "bench", "results", f"cli-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    paths = {"now": os.path.join(ROOT, "src")}
    with tempfile.TemporaryDirectory() as tmp:
        for key, rev in (("now", args.at), ("base", args.baseline)):
            if rev:
                os.makedirs(os.path.join(tmp, key))
                paths[key] = bc.library_at(rev, os.path.join(tmp, key))
        rows = []
        for n in (int(x) for x in args.leaves.split(",")):
            got = _one_size(n, args, paths)
            rows += got
            with open(out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in got)
    _report(rows, args.baseline)


if __name__ == "__main__":
    main()
