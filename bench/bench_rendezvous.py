"""What a save's rendezvous adds after the slowest process's write: the protocol alone.

N processes run `write_then_commit` (the protocol of every save and export) over the real
coordinators, jax.distributed's key-value store and torch.distributed's store (gloo); each
process's "write" is a sleep, process r's `r x --stagger-ms` long (which process is the
slowest rotates per round), and its commit does nothing. The figure is the lag from the end
of the slowest write to the return of the last process (process 0 has gathered every report
and published the outcome; the others have read it), and the store requests each process
made. On a real save that lag is added to the slowest process's write, which raw
writes (MLPerf Storage's floor) do not pay.

    python bench/bench_rendezvous.py [--procs 8] [--stagger-ms 40] [--rounds 20]
                                     [--wings jax,torch] [--baseline REV]

`--baseline REV`: the same with the library as of git commit REV, jobs interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import free_port, library_at, worker_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COUNTED = ("set", "get", "try_get", "get_dir", "increment", "delete")


def worker(wing: str, pid: int, n: int, port: int, stagger_s: float, rounds: int) -> None:
    from snapshard.coordination.rendezvous import Rendezvous, write_then_commit

    if wing == "torch":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=pid, world_size=n
        )
        from snapshard.torch.coordination import TorchStoreCoordinator

        coord: object = TorchStoreCoordinator()
    else:
        import jax

        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
        from snapshard.jax.distributed import JaxDistributedCoordinator

        coord = JaxDistributedCoordinator()
    calls = dict.fromkeys(COUNTED, 0)
    for name in COUNTED:
        method = getattr(coord, name)

        def counted(*a, _m=method, _name=name, **k):
            calls[_name] += 1
            return _m(*a, **k)

        setattr(coord, name, counted)
    out = []
    for i in range(rounds):
        coord.barrier(f"bench-rv-{i}", 60.0)  # type: ignore[attr-defined]
        for k in calls:
            calls[k] = 0
        delay = stagger_s * ((pid + i) % n)
        marks: dict[str, float] = {}

        def write(delay: float = delay, marks: dict[str, float] = marks) -> dict:
            time.sleep(delay)
            marks["written"] = time.monotonic()
            return {"pid": pid}

        rv = Rendezvous(coord, f"bench/rv/{i}", "bench rendezvous", 60.0)  # type: ignore[arg-type]
        write_then_commit(rv, write, lambda docs: None, lambda: None, lambda settled: None)
        out.append({**marks, "done": time.monotonic(), "requests": sum(calls.values())})
    print("RESULT " + json.dumps(out), flush=True)
    if wing == "torch":
        dist.destroy_process_group()
    else:
        jax.distributed.shutdown()


def job(src: str, wing: str, n: int, stagger_ms: float, rounds: int) -> list[list[dict]]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=src, JAX_PLATFORMS="cpu")
    args = [wing, str(n), str(port), str(stagger_ms / 1000), str(rounds)]

    def start(p: int) -> subprocess.Popen:
        cmd = [sys.executable, __file__, "--worker", args[0], str(p), *args[1:]]
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    return worker_results([start(p) for p in range(n)])


def lags(per_proc: list[list[dict]]) -> tuple[list[float], list[float], float]:
    """Per round: ms from the slowest write's end to the last return, and to process 0's
    return; store requests per process and round (median)."""
    last, leader, reqs = [], [], []
    for i in range(len(per_proc[0])):
        rnd = [p[i] for p in per_proc]
        written = max(r["written"] for r in rnd)
        last.append((max(r["done"] for r in rnd) - written) * 1000)
        leader.append((rnd[0]["done"] - written) * 1000)
        reqs += [r["requests"] for r in rnd]
    return last, leader, statistics.median(reqs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--stagger-ms", type=float, default=40.0)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--wings", default="jax,torch")
    ap.add_argument("--baseline", default=None, help="git commit to measure beside")
    ap.add_argument("--jobs", type=int, default=2, help="jobs per wing and version")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"here": os.path.join(ROOT, "src")}
        if args.baseline:
            sources = {args.baseline: library_at(args.baseline, tmp), **sources}
        rows: dict[tuple[str, str], list] = {}
        for j in range(args.jobs):
            order = list(sources.items())
            for name, src in order if j % 2 == 0 else order[::-1]:
                for wing in args.wings.split(","):
                    last, leader, reqs = lags(
                        job(src, wing, args.procs, args.stagger_ms, args.rounds)
                    )
                    r = rows.setdefault((wing, name), [[], [], []])
                    r[0] += last
                    r[1] += leader
                    r[2].append(reqs)
    print(
        f"\n{args.procs} processes, write_then_commit with writes staggered by "
        f"{args.stagger_ms:g} ms, {args.jobs} jobs x {args.rounds} rounds "
        f"({time.strftime('%Y-%m-%d')}): ms after the slowest write, median [p90]\n"
    )
    print(
        "| wing | library | last process returns | process 0 returns | store requests per process |"
    )
    print("|---|---|---|---|---|")

    def p90(xs: list[float]) -> float:
        return sorted(xs)[int(0.9 * (len(xs) - 1))]

    for (wing, name), (last, leader, reqs) in sorted(rows.items()):
        print(
            f"| {wing} | {name} | {statistics.median(last):.1f} [{p90(last):.1f}] | "
            f"{statistics.median(leader):.1f} [{p90(leader):.1f}] | {statistics.median(reqs):g} |"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        w = sys.argv[2:]
        worker(w[0], int(w[1]), int(w[2]), int(w[3]), float(w[4]), int(w[5]))
    else:
        main()
