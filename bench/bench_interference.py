"""What a save's background phase costs the training loop: a stand-in training loop (a fixed
slice of pure-Python work per step) runs in the main thread while the save drains, and its
steps per second are compared with its rate with no save (1.0: the save costs nothing).

Methods: snapshard's JAX `save_async`, its `CheckpointManager` and the manager with a local
tier; `snapshard.torch.save_async` and DCP's `async_save` with `snapshard.torch.StorageWriter`;
beside them Orbax's `AsyncCheckpointer` and DCP's own `FileSystemWriter` under `async_save`
with the thread and the process executor (job_interference.py says exactly what each does);
and the machine's floor, no library at all: a process of its own writing the same bytes
(floor_write) or busy with the loop's kind of work (floor_spin) beside the loop, which says
what any background work costs the loop on this machine.
States: 'large' (24 float32 arrays, 805 MB at --scale 1) and 'many' (--arrays small arrays,
10,000 by default). Every method and state runs in a fresh process (bench/job_interference.py)
per round, methods in an order rotated by the round; the job saves once unmeasured first.

Per method and state: the rate ratio (the loop's rate during the background phase over its
rate alone, both from the same job: paired per round), the longest stall (the longest gap
between consecutive step ends during the background phase; the loop alone's longest gap
beside it: what the machine itself costs), the blocking time and the background time
(from the blocking call's return to the save's end, as the library's own wait reports it);
medians [min-max] over rounds. A method that fails prints its error in its row.
Targets: rate ratio >= 0.97 and longest stall <= 10 ms, for both states and both wings.

    python bench/bench_interference.py --rounds 3
    python bench/bench_interference.py --rounds 1 --scale 0.02 --arrays 500    # a quick check
    python bench/bench_interference.py --only jax_async,orbax --states many
    python bench/bench_interference.py --analyze bench/results/interference-<time>.jsonl

Writes the results as JSON lines (--out, default bench/results/interference-<time>.jsonl).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
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
from job_interference import METHODS

HERE = os.path.dirname(os.path.abspath(__file__))
STATES = ("large", "many")
TARGET_RATIO, TARGET_STALL_MS = 0.97, 10.0


# ---------------------------------------------------------------- running the jobs
def job_cmd(method: str, state: str, r: int, args: argparse.Namespace) -> list[str]:
    return [sys.executable, os.path.join(HERE, "job_interference.py"), method,
            "--state", state, "--scale", str(args.scale), "--arrays", str(args.arrays),
            "--side", str(args.side), "--devices", str(args.devices),
            "--step-ms", str(args.step_ms), "--baseline-s", str(args.baseline_s),
            "--round", str(r)]  # fmt: skip


def run_job(method: str, state: str, r: int, args: argparse.Namespace) -> dict[str, Any]:
    """One job, bounded by --timeout, none of its processes left behind (DCP's process
    executor starts one of its own): its RESULT, or a row naming why it gave none."""
    head = {"method": method, "state": state, "round": r}
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(job_cmd(method, state, r, args), stdout=subprocess.PIPE,
                             stderr=err, env=env, text=True, start_new_session=True)  # fmt: skip
        try:
            out, _ = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {**head, "error": f"over --timeout {args.timeout} s"}
        finally:
            # The job's session, whatever of it still runs, before the job is reaped (its
            # id cannot name another group until then).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        rows = [json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT ")]
        if rows:
            return rows[0]
        err.seek(0)
        lines = [x for x in err.read().splitlines() if x.strip()]
    last = lines[-1][:300] if lines else "no output"
    return {**head, "error": f"exit {p.returncode}: {last}"}


def run_all(args: argparse.Namespace, out_path: str) -> list[dict[str, Any]]:
    rows = []
    with open(out_path, "a") as out:
        for r in range(args.rounds):
            for state in args.states:
                k = r % len(args.methods)
                for method in args.methods[k:] + args.methods[:k]:
                    bc.settle()
                    t0 = time.perf_counter()
                    row = run_job(method, state, r, args) | {"loadavg": os.getloadavg()[0]}
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    what = row.get("error") or f"ratio {row['rate_ratio']:.3f}"
                    print(f"[round {r}] {method} {state}: {what} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    return rows


# ---------------------------------------------------------------- the table
def table(rows: list[dict[str, Any]]) -> None:
    """One row per method and state: medians [min-max] over the rounds, and whether the
    medians meet the targets; a method that failed in every round shows its error."""
    print("\n## The training loop during a save's background phase (medians [min-max])\n")
    print("| method | state | MB | rate ratio | longest stall ms | loop alone: longest gap ms "
          "| blocking ms | background s | rounds | targets met |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for state in dict.fromkeys(r["state"] for r in rows):
        for method in dict.fromkeys(r["method"] for r in rows if r["state"] == state):
            print(table_row(method, state, [
                r for r in rows if r["method"] == method and r["state"] == state
            ]))  # fmt: skip
    print(f"\nTargets: rate ratio >= {TARGET_RATIO} and longest stall <= {TARGET_STALL_MS:g} ms, "
          "for both states and both wings. Figures of a busy machine are not meaningful: "
          "the loop alone's longest gap says how busy it was.")  # fmt: skip


def table_row(method: str, state: str, runs: list[dict[str, Any]]) -> str:
    ok = [r for r in runs if "error" not in r]
    failed = [r for r in runs if "error" in r]
    if not ok:
        return f"| {method} | {state} | | failed: {failed[0]['error']} | | | | | 0/{len(runs)} | |"

    def col(key: str, scale: float = 1.0) -> list[float]:
        return [r[key] * scale for r in ok]

    ratio, stall = col("rate_ratio"), col("stall_s", 1000)
    met = statistics.median(ratio) >= TARGET_RATIO and statistics.median(stall) <= TARGET_STALL_MS
    note = f" ({len(failed)} failed: {failed[0]['error'][:80]})" if failed else ""
    return (
        f"| {method} | {state} | {ok[0]['bytes'] / 1e6:.0f} | {bc.spread(ratio, 3)} "
        f"| {bc.spread(stall, 1)} | {bc.spread(col('stall_alone_s', 1000), 1)} "
        f"| {bc.spread(col('blocking_s', 1000), 1)} | {bc.spread(col('background_s'), 2)} "
        f"| {len(ok)}/{len(runs)}{note} | {'yes' if met else 'NO'} |"
    )


def names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated list of names, each checked against `allowed`."""
    out = [x for x in text.split(",") if x]
    bad = [x for x in out if x not in allowed]
    if bad or not out:
        raise SystemExit(f"unknown {what} {bad or text!r}; choose from {', '.join(allowed)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--states", default=",".join(STATES), help="large,many")
    ap.add_argument("--methods", "--only", dest="methods", default=",".join(METHODS),
                    help=f"comma-separated, of {', '.join(METHODS)}")  # fmt: skip
    ap.add_argument("--scale", type=float, default=1.0, help="large: rows x scale")
    ap.add_argument("--arrays", type=int, default=10_000, help="many: how many arrays")
    ap.add_argument("--side", type=int, default=64, help="many: arrays of side x side float32")
    ap.add_argument("--devices", type=int, default=1, help="JAX: CPU devices per job")
    ap.add_argument("--step-ms", type=float, default=1.5, help="CPU time of a loop step")
    ap.add_argument("--baseline-s", type=float, default=2.0, help="the loop alone, per job")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per job")
    ap.add_argument("--out", default=None)
    ap.add_argument("--analyze", default=None, help="reprint the table of an earlier run")
    args = ap.parse_args()
    if args.analyze:
        with open(args.analyze) as f:
            table([json.loads(line) for line in f if line.strip()])
        return
    args.states = names(args.states, STATES, "state")
    args.methods = names(args.methods, METHODS, "method")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"interference-{stamp}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    table(run_all(args, out_path))
    print(f"\nresults: {out_path}")


if __name__ == "__main__":
    main()
