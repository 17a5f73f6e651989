"""Asynchronous saves of the bench state: the time the training step waits (blocking) and the
time until the checkpoint is durable (total), for snapshard's CheckpointManager, a plain host
copy of the owned bytes, and Orbax's async CheckpointManager (default and without
replica-parallel). Every variant runs in a fresh process (job_async.py), rounds interleaved.

usage: python bench_async.py [--rounds 5] [--scale 1.0] [--out FILE.jsonl]
Targets (CPU backend): snapshard blocking <= 0.25 x the plain copy and <= 0.5 x Orbax's best
blocking time; total >= 3x faster than Orbax's default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict

import common as bc

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("copy", "snapshard", "orbax", "orbax_norp")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"async-{stamp}.jsonl")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    rows = []
    with open(out_path, "a") as out:
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for v in order:
                os.sync()
                cmd = [
                    sys.executable,
                    "job_async.py",
                    v,
                    "--scale",
                    str(args.scale),
                    "--round",
                    str(r),
                ]
                p = subprocess.run(
                    cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
                for line in p.stdout.splitlines():
                    if line.startswith("RESULT "):
                        d = json.loads(line[7:]) | {"round": r, "loadavg": os.getloadavg()[0]}
                        rows.append(d)
                        out.write(json.dumps(d) + "\n")
                print(f"[round {r}] {v}: rc={p.returncode}", flush=True)
    by: dict[str, dict[int, dict]] = defaultdict(dict)
    for d in rows:
        by[d["method"].removeprefix("async_")][d["round"]] = d
    med = statistics.median

    def col(v: str, key: str) -> list[float]:
        return [d[key] for d in by[v].values() if key in d]

    def ratio(a: str, ka: str, b: str, kb: str) -> str:
        pairs = [
            by[a][r][ka] / by[b][r][kb]
            for r in by[a]
            if r in by[b] and ka in by[a][r] and kb in by[b][r]
        ]
        return f"{med(pairs):.3f}" if pairs else "n/a"

    print(
        f"\n## Asynchronous save, {bc.payload_bytes(args.scale) / 1e9:.2f} GB, {args.rounds} rounds (medians)\n"
    )
    print("| variant | blocking s | total (durable) s |")
    print("|---|---|---|")
    for v in VARIANTS:
        b, t = col(v, "blocking_s"), col(v, "save_s")
        print(f"| {v} | {med(b):.4f} | {med(t):.2f} |" if t else f"| {v} | {med(b):.4f} | - |")
    print("\n| ratio (paired by round) | value | target |")
    print("|---|---|---|")
    print(
        f"| snapshard blocking / plain host copy | {ratio('snapshard', 'blocking_s', 'copy', 'blocking_s')} | <= 0.25 |"
    )
    best = (
        "orbax"
        if med(col("orbax", "blocking_s")) <= med(col("orbax_norp", "blocking_s"))
        else "orbax_norp"
    )
    print(
        f"| snapshard blocking / Orbax best blocking ({best}) | {ratio('snapshard', 'blocking_s', best, 'blocking_s')} | <= 0.5 |"
    )
    print(
        f"| Orbax default total / snapshard total | {ratio('orbax', 'save_s', 'snapshard', 'save_s')} | >= 3 |"
    )
    print(f"\nresults: {out_path}")


if __name__ == "__main__":
    main()
