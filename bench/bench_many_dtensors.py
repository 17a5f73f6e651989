"""Save and restore of a torch state of many small DTensors, where the cost per leaf, not the
bytes, sets the time: snapshard.torch against torch.distributed.checkpoint (DCP).

Each round runs every library on `--world` fresh processes (gloo, CPU, started as torchrun
starts them: one process per rank, a TCP rendezvous on 127.0.0.1), in an order rotated by
the round. Every rank makes N DTensors of `--side` x 16 float32 on a 1-D device mesh of the
ranks, the even ones Shard(0) and the odd ones Replicate() (an FSDP2 state with its
norms, biases and small adapters), then saves them (durable: snapshard fsyncs its files
and directories; DCP's FileSystemWriter has sync_files=True and rank 0 fsyncs the
directory inside the time) and restores them in place into preallocated DTensor targets of
the same layout, `--repeats` + 1 times; the first of each is reported apart (what a restart
pays), the others as their median. A time is the slowest rank's, every rank starting
together after a barrier. Every restore is checked bit for bit on every rank, then the
targets are zeroed again. `--world 1`: one process, the same DTensors on a mesh of one
rank; `--plain`: plain tensors instead of DTensors (every rank then holds whole tensors).

    python bench/bench_many_dtensors.py --arrays 10000 --rounds 3 --repeats 2
    python bench/bench_many_dtensors.py --arrays 1000,10000,100000 --world 1 --rounds 1
    python bench/bench_many_dtensors.py --arrays 100000 --rounds 1 --repeats 1 --only snap_torch
    python bench/bench_many_dtensors.py --arrays 10000 --rounds 1 --repeats 1 --profile prof
        # then: python -m pstats prof.snap_torch.10000.load.0

Memory: per rank, the peak RSS of each operation (the kernel's high-water mark, reset when
it starts) less the RSS before it, against the bytes of the state the rank holds (its local
shards); and the rank's RSS before its first save against the same bytes.

Prints medians over rounds (slowest rank), microseconds per leaf for every N, and the
ratios DCP / snapshard paired per round; writes the results as JSON lines (--out, default
bench/results/many-dtensors-<time>.jsonl). Every job has a time limit (--timeout); on
expiry its ranks are killed and the run stops with their error output.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc

LIBRARIES = ("snap_torch", "dcp")
COLS = 16


# ---------------------------------------------------------------- one rank
def _state(n: int, side: int, world: int, rank: int, mesh: Any, plain: bool) -> tuple[dict, dict]:
    """(state, zeroed target) of this rank: name -> DTensor (or plain tensor)."""
    import numpy as np
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    full = torch.from_numpy(np.random.default_rng(0).standard_normal((n, side, COLS), np.float32))
    state: dict[str, Any] = {}
    target: dict[str, Any] = {}
    for i in range(n):
        name = f"layers.{i:06d}.w"
        cut = i % 2 == 0 and not plain
        local = full[i].chunk(world, dim=0)[rank] if cut else full[i]
        local = local.clone()
        zeros = torch.zeros_like(local)
        if plain:
            state[name], target[name] = local, zeros
            continue
        place = [Shard(0) if cut else Replicate()]
        state[name] = DTensor.from_local(local, mesh, place, run_check=False)
        target[name] = DTensor.from_local(zeros, mesh, place, run_check=False)
    return state, target


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _exact(state: dict, target: dict) -> bool:
    import torch

    return all(torch.equal(_local(target[k]), _local(v)) for k, v in state.items())


def _zero(target: dict) -> None:
    for t in target.values():
        _local(t).zero_()


def _ops(lib: str, state: dict, target: dict, rank: int) -> tuple[Any, Any]:
    """(save(path), load(path)) of one library."""
    if lib == "snap_torch":
        import snapshard.torch as st

        def save(path: str) -> None:
            st.save(path, state)

        def load(path: str) -> None:
            st.load(path, target)

        return save, load
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    def dcp_save(path: str) -> None:  # sync_files=True (the default): the files fsync'd
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
        if rank == 0:
            bc.fsync_path(path)
        dist.barrier()

    def dcp_load(path: str) -> None:
        dcp.load(target, storage_reader=dcp.FileSystemReader(path))

    return dcp_save, dcp_load


def _timed(fn: Any, path: str, profile: str | None) -> tuple[float, dict[str, float]]:
    """fn(path) after a barrier: (seconds, meter) on this rank; with `profile`, under
    cProfile, its statistics written to that file (the time then includes the profiler's)."""
    import cProfile

    import torch.distributed as dist

    dist.barrier()
    prof = cProfile.Profile() if profile else None
    with bc.Meter() as m:
        if prof is not None:
            prof.runcall(fn, path)
        else:
            fn(path)
    if prof is not None:
        prof.dump_stats(profile)
    return m.wall, m.as_dict("op")


def _rank_job(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
        world_size=args.world,
    )  # fmt: skip
    rank, world = args.rank, args.world
    mesh = init_device_mesh("cpu", (world,))
    state, target = _state(args.arrays, args.side, world, rank, mesh, args.plain)
    held = sum(_local(t).nbytes for t in state.values())
    root = bc.ckpt_dir(f"many-dt-{args.job}")
    if rank == 0:
        bc.fresh_dir(root)
        os.makedirs(root, exist_ok=True)
    rss_start = bc.Meter()
    with rss_start:
        pass
    save, load = _ops(args.job, state, target, rank)
    times: dict[str, list[float]] = {"save": [], "load": []}
    growth: dict[str, list[int]] = {"save": [], "load": []}
    ok = True
    for r in range(args.repeats + 1):
        path = os.path.join(root, f"step_{r}")
        for name, fn in (("save", save), ("load", load)):
            last = r == args.repeats and args.profile
            wall, meter = _timed(fn, path, f"{args.profile}.{name}.{rank}" if last else None)
            times[name].append(wall)
            growth[name].append(meter["op_peak_rss_B"] - meter["op_rss_before_B"])
        ok = ok and _exact(state, target)
        _zero(target)
        dist.barrier()
        if rank == 0:
            bc.remove(path)
    mine = {"times": times, "growth": growth, "exact": ok, "held": held,
            "rss0": rss_start.rss0}  # fmt: skip
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        bc.remove(root)
        _emit(args, every)
    dist.barrier()
    dist.destroy_process_group()


def _emit(args: argparse.Namespace, every: list[dict[str, Any]]) -> None:
    """The job's result line: times of the slowest rank, memory of every rank."""
    out: dict[str, Any] = {"lib": args.job, "arrays": args.arrays, "side": args.side,
                           "world": args.world, "plain": args.plain}  # fmt: skip
    for op in ("save", "load"):
        slowest = [max(e["times"][op][i] for e in every) for i in range(args.repeats + 1)]
        out[f"first_{op}_s"] = slowest[0]
        out[f"{op}_s"] = statistics.median(slowest[1:])
        out[f"{op}_growth_B"] = [max(e["growth"][op]) for e in every]
    out["held_B"] = [e["held"] for e in every]
    out["rss_start_B"] = [e["rss0"] for e in every]
    out["exact"] = all(e["exact"] for e in every)
    bc.emit(**out)


# ---------------------------------------------------------------- the driver
def _run(lib: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One library's job on `--world` fresh ranks, killed past `--timeout`."""
    port = bc.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": str(args.world),
           "PYTHONWARNINGS": "ignore"}  # fmt: skip
    cmd = [sys.executable, os.path.abspath(__file__), "--job", lib, "--port", str(port),
           "--arrays", str(n), "--side", str(args.side), "--repeats", str(args.repeats),
           "--world", str(args.world)] + (["--plain"] if args.plain else [])  # fmt: skip
    if args.profile:
        cmd += ["--profile", f"{os.path.abspath(args.profile)}.{lib}.{n}"]
    with contextlib.ExitStack() as stack:
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(args.world)]
        procs = [
            subprocess.Popen(
                [*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=errs[r], env=env, text=True
            )
            for r in range(args.world)
        ]
        deadline = time.monotonic() + args.timeout
        outs: list[str] = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            pass
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for line in (outs[0] if outs else "").splitlines():
            if line.startswith("RESULT "):
                return dict(json.loads(line[7:]))
        tails = []
        for r, f in enumerate(errs):
            f.seek(0)
            tails.append(f"rank {r}:\n{f.read()[-2000:]}")
    codes = [p.returncode for p in procs]
    raise SystemExit(
        f"{lib} at {n} leaves gave no result (exit codes {codes}):\n" + "\n".join(tails)
    )


def _report(rows: list[dict[str, Any]], libs: list[str]) -> None:
    for n in sorted({r["arrays"] for r in rows}):
        at = [r for r in rows if r["arrays"] == n]
        by = {
            lib: sorted((r for r in at if r["lib"] == lib), key=lambda r: r["round"])
            for lib in libs
        }
        one = at[0]
        kind = "plain tensors" if one["plain"] else "DTensors (half Shard(0), half Replicate)"
        print(f"\n## {n} {kind} of {one['side']}x{COLS} float32 on {one['world']} rank(s), "
              "slowest rank, medians over rounds\n")  # fmt: skip
        print("| library | first save | first restore | save | restore | save us/leaf | "
              "restore us/leaf | peak growth save / restore (x held) | bit-exact |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for lib, rs in by.items():
            cells = [bc.spread([r[k] for r in rs], 3) for k in
                     ("first_save_s", "first_load_s", "save_s", "load_s")]  # fmt: skip
            per = [
                f"{statistics.median(r[k] for r in rs) / n * 1e6:.1f}" for k in ("save_s", "load_s")
            ]
            mem = "/".join(
                f"{max(g / h for r in rs for g, h in zip(r[k], r['held_B'], strict=True)):.2f}"
                for k in ("save_growth_B", "load_growth_B")
            )
            print(f"| {lib} | " + " | ".join(cells + per) + f" | {mem} | "
                  f"{all(r['exact'] for r in rs)} |")  # fmt: skip
        held = at[0]["held_B"]
        start = max(s / h for r in at for s, h in zip(r["rss_start_B"], r["held_B"], strict=True))
        print(f"\nstate held per rank {[round(h / 2**20, 1) for h in held]} MiB; RSS before "
              f"the first save up to {start:.1f}x that (interpreter, torch, the state, its target)")  # fmt: skip
        if set(libs) == set(LIBRARIES):
            checks = []
            for k in ("first_save_s", "first_load_s", "save_s", "load_s"):
                ratios = [d[k] / s[k] for d, s in zip(by["dcp"], by["snap_torch"], strict=True)]
                target = ">= 1.5" if k in ("save_s", "load_s") else ""
                checks.append((f"dcp / snap_torch, {k[:-2].replace('_', ' ')}", ratios, target))
            bc.ratio_table(f"Ratios at {n} leaves, paired by round (> 1: snapshard faster)", checks)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arrays", default="10000", help="leaf counts, comma-separated")
    ap.add_argument("--side", type=int, default=16, help="rows of every leaf (x 16 columns)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--world", type=int, default=2, help="ranks (gloo processes)")
    ap.add_argument("--plain", action="store_true", help="plain tensors instead of DTensors")
    ap.add_argument("--only", default=None, help="libraries to run, comma-separated")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds a job may take")
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="PREFIX",
        help="cProfile every rank's last save and restore into PREFIX.<op>.<rank>",
    )
    ap.add_argument("--job", choices=LIBRARIES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        args.arrays = int(args.arrays)
        _rank_job(args)
        return
    if args.repeats < 1:
        ap.error("--repeats must be at least 1 (the first call is reported apart)")
    libs = [x for x in (args.only or ",".join(LIBRARIES)).split(",") if x]
    counts = [int(x) for x in args.arrays.split(",") if x]
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"many-dtensors-{time.strftime('%Y%m%d-%H%M%S')}.jsonl",
    )  # fmt: skip
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = []
    for n in counts:
        for r in range(args.rounds):
            for lib in libs[r % len(libs) :] + libs[: r % len(libs)]:
                row = _run(lib, n, args) | {"round": r}
                rows.append(row)
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{n} leaves, round {r} {lib}: save {row['save_s']:.3f} s, "
                      f"load {row['load_s']:.3f} s, exact {row['exact']}", flush=True)  # fmt: skip
    _report(rows, libs)
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
