"""Paired save ratios of a peer-bench run (`run_all.py` with the snap_sp / snap_mp jobs):
per round, snapshard's durable save (the manager's save + wait_until_finished, the max over
processes) against the best raw fsync'd write of the same bytes (1 or 2 threads, whichever
was faster in that round) and against safetensors + fsync of the same round.

usage: python peer_save_ratios.py RESULTS_DIR
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict

from common import ratio_table, spread

RAW = ("phys_write_1thread", "phys_write_2threads_2x1GiB")
SNAP = ("snap_sp_default", "snap_mp2_default")


def main() -> None:
    with open(os.path.join(sys.argv[1], "results.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    payload = next(r["bytes"] for r in rows if r["method"] in SNAP)
    raw: dict[int, list[float]] = defaultdict(list)  # seconds to write `payload` bytes
    snap: dict[str, dict[int, float]] = defaultdict(dict)
    blocking: dict[str, dict[int, float]] = defaultdict(dict)
    st: dict[int, float] = {}
    for r in rows:
        m, k = r["method"], r["round"]
        if m in RAW:
            raw[k].append(payload / (r["gbps"] * 1e9))
        elif m in SNAP and r.get("rep", 0) >= 0:
            snap[m][k] = max(snap[m].get(k, 0.0), r["total_s"])
            blocking[m][k] = max(blocking[m].get(k, 0.0), r["blocking_s"])
        elif m == "safetensors":
            st[k] = r["total_s"]
    best = {k: min(v) for k, v in raw.items()}
    print(f"payload {payload:,} B; rounds {sorted(best)}\n")
    print("| round | best raw write s | safetensors s | " + " | ".join(SNAP) + " |")
    print("|---|---|---|" + "---|" * len(SNAP))
    for k in sorted(best):
        cells = [f"{snap[m][k]:.2f}" if k in snap[m] else "n/a" for m in SNAP]
        print(
            f"| {k} | {best[k]:.2f} | {st.get(k, float('nan')):.2f} | " + " | ".join(cells) + " |"
        )
    checks = []
    for m in SNAP:
        checks.append(
            (
                f"{m} durable save / best raw write",
                [snap[m][k] / best[k] for k in snap[m] if k in best],
                "<= 1.1",
            )
        )
        checks.append(
            (
                f"{m} durable save / safetensors + fsync",
                [snap[m][k] / st[k] for k in snap[m] if k in st],
                "<= 1.0",
            )
        )
    ratio_table("paired by round, median [min-max]", checks)
    for m in SNAP:
        print(
            f"\n{m}: blocking s {spread(list(blocking[m].values()), 3)}; "
            f"durable save s {spread(list(snap[m].values()))}; median GB/s "
            f"{payload / statistics.median(snap[m].values()) / 1e9 if snap[m] else float('nan'):.2f}"
        )


if __name__ == "__main__":
    main()
