"""Save and restore of the ~2 GiB bench state: snapshard next to Orbax, PyTorch DCP, np.save,
safetensors and the machine's own limits, measured the same way in the same run.

Every round runs each job once in a fresh process, in an order rotated by the round number,
after an os.sync() and a short pause; inside a job the variants alternate their order between
rounds. Results go to a JSON-lines file; the tables are medians over rounds, and ratios are
paired by round (both sides measured in the same round) before taking the median.

usage: python bench_save_restore.py [--rounds 3] [--scale 1.0] [--only snapshard,orbax,...]
                                    [--out FILE.jsonl]
       python bench_save_restore.py --analyze FILE.jsonl      # tables of an earlier run
Checkpoints go under $SNAPSHARD_BENCH_DIR (default: <temp dir>/snapshard-bench) and are
deleted after every job; disk use peaks at about twice the state (the 2-thread raw write).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import common as bc

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = ("phys", "floor", "snapshard", "fresh", "orbax", "dcp", "plain")


def job_command(name: str, r: int, scale: float) -> list[str]:
    common = ["--scale", str(scale), "--round", str(r)]
    if name == "phys":
        # the whole set: write probes, then reads of the file write1 left behind
        return [sys.executable, "job_phys.py", *common, "write1", "read", "read_evicted", "write2"]
    return [sys.executable, f"job_{name}.py", *common]


def run_job(name: str, r: int, scale: float, out, logs: str) -> None:
    os.sync()
    time.sleep(2)
    cmd = job_command(name, r, scale)
    load0 = os.getloadavg()[0]
    busy0, cpu0, t0 = bc.sys_cpu()[0], bc.children_cpu(), time.perf_counter()
    with open(os.path.join(logs, f"r{r}_{name}.err"), "w") as err:
        p = subprocess.run(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - t0
    others = bc.sys_cpu()[0] - busy0 - (bc.children_cpu() - cpu0)
    n = 0
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            d = json.loads(line[7:])
            d.update(round=r, job=name, scale=scale, wallclock=time.time())
            out.write(json.dumps(d) + "\n")
            n += 1
    # How busy the rest of the machine was while this job ran.
    out.write(
        json.dumps(
            {
                "method": "job",
                "job": name,
                "round": r,
                "rc": p.returncode,
                "wall_s": round(wall, 2),
                "others_cpu_s": round(others, 2),
                "loadavg_1m_start": load0,
                "loadavg_1m_end": os.getloadavg()[0],
            }
        )
        + "\n"
    )
    out.flush()
    status = "ok" if p.returncode == 0 and n else f"FAILED rc={p.returncode} (see {logs})"
    print(f"[round {r}] {name}: {wall:.0f} s, {n} results, {status}", flush=True)


# ---------------------------------------------------------------- analysis
med = statistics.median


def analyze(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    by: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by[row["method"]].append(row)
    # value of `key` for `method` per round (median if several in a round)
    per_round: dict[tuple[str, str], dict[int, float]] = {}

    def pr(method: str, key: str) -> dict[int, float]:
        if (method, key) not in per_round:
            acc: dict[int, list[float]] = defaultdict(list)
            for row in by.get(method, []):
                v = nested(row, key)
                if v is not None:
                    acc[row["round"]].append(v)
            per_round[method, key] = {k: med(v) for k, v in acc.items()}
        return per_round[method, key]

    def vals(method: str, key: str) -> list[float]:
        return list(pr(method, key).values())

    scale = next((r["scale"] for r in rows if "scale" in r), 1.0)
    nbytes = bc.payload_bytes(scale)
    print(f"# Save / restore bench: {path}")
    print(f"state {nbytes:,} B (scale {scale}); medians over rounds [min-max]; GB = 1e9 B\n")

    print("## Limits and floors\n")
    print("| measurement | seconds | GB/s | n |")
    print("|---|---|---|---|")
    for m in (
        "raw_write_1thread",
        "raw_write_2threads",
        "raw_read_warm",
        "raw_read_evicted",
        "floor_device_put_same",
        "floor_device_put_reshard",
    ):
        s = vals(m, "op_s")
        gbps = [nbytes / x / 1e9 for x in s]
        print(f"| {m} | {bc.spread(s)} | {bc.spread(gbps)} | {len(s)} |")

    print("\n## Save and restore\n")
    print(
        "| method | n | blocking s | durable save s | save GB/s | restore warm s "
        "| restore evicted s | reshard warm s | save RSS growth GB | save CPU s "
        "| others' CPU in save (core-s) | bit-exact |"
    )
    print("|" + "---|" * 12)
    for m in ("snapshard", "orbax", "dcp_t1", "dcp_t2", "npsave", "safetensors"):
        if m not in by:
            continue
        save = vals(m, "save_s")
        blocking = vals(m, "blocking_s") or save
        growth = [
            (r["save_peak_rss_B"] - r["save_rss_before_B"]) / 1e9
            for r in by[m]
            if r.get("save_peak_rss_B")
        ]
        others = [max(0.0, r["save_sys_busy_s"] - r["save_cpu_s"]) for r in by[m]]
        exact = all(r.get("bit_exact", False) for r in by[m])
        print(
            f"| {m} | {len(save)} | {bc.spread(blocking)} | {bc.spread(save)} "
            f"| {bc.spread([nbytes / x / 1e9 for x in save])} | {bc.spread(vals(m, 'restore_warm_s'))} "
            f"| {bc.spread(vals(m, 'restore_evicted_s'))} | {bc.spread(vals(m, 'reshard_warm_s'))} "
            f"| {bc.spread(growth)} | {bc.spread(vals(m, 'save_cpu_s'), 1)} | {bc.spread(others, 1)} "
            f"| {exact} |"
        )

    def ratio(num, den) -> list[float]:
        """num / den per round, where num and den are {round: value} (paired)."""
        return [num[k] / den[k] for k in num if den.get(k)]

    def add(*parts: dict[int, float]) -> dict[int, float]:
        keys = set.intersection(*(set(p) for p in parts))
        return {k: sum(p[k] for p in parts) for k in keys}

    snap = lambda key: pr("snapshard", key)  # noqa: E731
    orbax = lambda key: pr("orbax", key)  # noqa: E731
    raw_w1, raw_w2 = pr("raw_write_1thread", "op_s"), pr("raw_write_2threads", "op_s")
    read_warm, read_ev = pr("raw_read_warm", "op_s"), pr("raw_read_evicted", "op_s")
    floor_same = pr("floor_device_put_same", "op_s")
    floor_re = pr("floor_device_put_reshard", "op_s")
    growth = {
        r["round"]: (r["save_peak_rss_B"] - r["save_rss_before_B"]) / r["bytes_written"]
        for r in by.get("snapshard", [])
        if r.get("save_peak_rss_B")
    }
    peak = {
        r["round"]: r["save_peak_rss_B"] / r["bytes_written"]
        for r in by.get("snapshard", [])
        if r.get("save_peak_rss_B")
    }
    checks = [
        (
            "durable save: raw 1-thread write s / snapshard save s",
            ratio(raw_w1, snap("save_s")),
            ">= 0.9",
        ),
        (
            "durable save: raw 2-thread write s / snapshard save s",
            ratio(raw_w2, snap("save_s")),
            "",
        ),
        ("save: Orbax total s / snapshard s", ratio(orbax("save_s"), snap("save_s")), ">= 3"),
        (
            "save, blocking part: Orbax / snapshard",
            ratio(orbax("blocking_s"), snap("blocking_s")),
            "",
        ),
        (
            "restore warm / (raw read warm + device_put floor)",
            ratio(snap("restore_warm_s"), add(read_warm, floor_same)),
            "<= 1.2",
        ),
        (
            "restore evicted / (raw read evicted + device_put floor)",
            ratio(snap("restore_evicted_s"), add(read_ev, floor_same)),
            "<= 1.2",
        ),
        (
            "restore warm: Orbax s / snapshard s",
            ratio(orbax("restore_warm_s"), snap("restore_warm_s")),
            ">= 2",
        ),
        (
            "restore evicted: Orbax s / snapshard s",
            ratio(orbax("restore_evicted_s"), snap("restore_evicted_s")),
            ">= 2",
        ),
        (
            "reshard: Orbax s / snapshard s",
            ratio(orbax("reshard_warm_s"), snap("reshard_warm_s")),
            "",
        ),
        (
            "reshard / (raw read warm + device_put reshard floor)",
            ratio(snap("reshard_warm_s"), add(read_warm, floor_re)),
            "<= 1.2",
        ),
        (
            "reshard: bytes read / bytes needed",
            list(snap("reshard_warm_stats.read_amplification").values()),
            "<= 1.05",
        ),
        (
            "restore: bytes read / bytes needed",
            list(snap("restore_warm_stats.read_amplification").values()),
            "",
        ),
        (
            "fresh-process restore warm / (raw read warm + device_put floor)",
            ratio(pr("fresh_load_warm", "restore_s"), add(read_warm, floor_same)),
            "<= 1.2",
        ),
        (
            "fresh-process restore evicted / (raw read evicted + device_put floor)",
            ratio(pr("fresh_load_evicted", "restore_s"), add(read_ev, floor_same)),
            "",
        ),
        (
            "fresh process: CheckpointManager.restore s / load s",
            ratio(pr("fresh_manager_warm", "restore_s"), pr("fresh_load_warm", "restore_s")),
            "<= 1.05",
        ),
        (
            "first restore after a save (source alive) / the repeated one (same process)",
            ratio(snap("restore_alive_s"), snap("restore_repeat_s")),
            "<= 1.5",
        ),
        (
            "first restore after a save, source deleted / the repeated one",
            ratio(snap("restore_warm_s"), snap("restore_repeat_s")),
            "<= 1.5",
        ),
        (
            "a fresh process that first touches freed memory / fresh-process restore warm",
            ratio(pr("fresh_first", "restore_s"), pr("fresh_load_warm", "restore_s")),
            "",
        ),
        (
            "fresh-process restore: Orbax s / snapshard s",
            ratio(orbax("restore_warm_s"), pr("fresh_load_warm", "restore_s")),
            ">= 2",
        ),
        (
            "restore warm: DCP (best threads) s / snapshard fresh-process s",
            ratio(
                {
                    k: min(
                        v
                        for v in (
                            pr("dcp_t1", "restore_warm_s").get(k),
                            pr("dcp_t2", "restore_warm_s").get(k),
                        )
                        if v
                    )
                    for k in pr("dcp_t1", "restore_warm_s")
                },
                pr("fresh_load_warm", "restore_s"),
            ),
            ">= 1.5",
        ),
        ("save: RSS growth (peak - before) / bytes written", list(growth.values()), "<= 1.1"),
        ("save: peak RSS / bytes written (incl. the CPU 'device' state)", list(peak.values()), ""),
    ]
    bc.ratio_table("snapshard: ratios (paired by round, median [min-max])", checks, 2)

    if by.get("snapshard"):
        print("\n## snapshard phases (seconds, median [min-max])\n")
        print("| step | phases |")
        print("|---|---|")
        parts = ", ".join(
            f"{k} {bc.spread(vals('snapshard', 'timings.' + k), 3)}"
            for k in ("plan_s", "stage_s", "write_s", "commit_s")
        )
        print(f"| save | {parts} |")
        for step in (
            "restore_alive",
            "restore_warm",
            "restore_repeat",
            "restore_evicted",
            "reshard_warm",
        ):
            parts = ", ".join(
                f"{k} {bc.spread(vals('snapshard', f'{step}_stats.{k}'), 3)}"
                for k in ("read_s", "assemble_s", "total_s")
            )
            reads = vals("snapshard", f"{step}_stats.reads")
            print(f"| {step} | {parts}; reads {bc.spread(reads, 0)} |")

    jobs = by.get("job", [])
    if jobs:
        print("\n## Machine load while the jobs ran\n")
        print("| job | n | wall s | others' CPU core-s | others' busy cores (mean) | loadavg 1m |")
        print("|---|---|---|---|---|---|")
        for j in JOBS:
            js = [r for r in jobs if r["job"] == j]
            if not js:
                continue
            busy = [r["others_cpu_s"] / r["wall_s"] for r in js if r["wall_s"]]
            print(
                f"| {j} | {len(js)} | {bc.spread([r['wall_s'] for r in js], 0)} "
                f"| {bc.spread([r['others_cpu_s'] for r in js], 1)} | {bc.spread(busy)} "
                f"| {bc.spread([r['loadavg_1m_start'] for r in js])} |"
            )
        total_wall = sum(r["wall_s"] for r in jobs)
        total_others = sum(r["others_cpu_s"] for r in jobs)
        print(
            f"\nOver the whole run: {total_wall / 60:.1f} min of jobs, others used "
            f"{total_others / total_wall:.2f} of the {os.cpu_count()} cores on average "
            "(machine CPU from /proc/stat minus the jobs' own; kernel writeback for our "
            "writes counts as others')."
        )
        failed = [f"r{r['round']} {r['job']}" for r in jobs if r["rc"] != 0]
        if failed:
            print("FAILED jobs:", ", ".join(failed))


def nested(row: dict, key: str):
    v = row
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the state size")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(JOBS)}")
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument("--analyze", default=None, metavar="FILE", help="print the tables of FILE")
    args = ap.parse_args()
    if args.analyze:
        analyze(args.analyze)
        return
    jobs = [j for j in JOBS if not args.only or j in args.only.split(",")]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"save_restore-{stamp}.jsonl")
    logs = os.path.splitext(out_path)[0] + "-logs"
    os.makedirs(logs, exist_ok=True)
    print(f"results: {out_path}; checkpoints under {bc.bench_dir()}", flush=True)
    with open(out_path, "a") as out:
        for r in range(args.rounds):
            k = r % len(jobs)
            for name in jobs[k:] + jobs[:k]:
                run_job(name, r, args.scale, out, logs)
    bc.remove(os.path.join(bc.bench_dir(), "ckpt"))
    analyze(out_path)


if __name__ == "__main__":
    main()
