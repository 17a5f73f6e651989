"""Multi-tier checkpoints on 4 processes x 2 CPU devices: restore time from the local tier,
from a peer (one process lost its local tier) and from the persistent tier (local
filesystem, and the local S3 server with --s3); blocking time of a step that saves to both
tiers against one tier.

Per round: the save phase saves steps 1..5 with a local tier every step (one replica on
the next process) and the persistent tier every 2 steps (so the newest local step, 5, is
newer than the newest persistent one, 4), then a manager with no local tier
saves twice; the restore phases then restore the newest step with every local tier in
place, with process 2's local tier deleted, and with no local tier at all.

usage: python bench_tiers.py [--rounds 3] [--scale 0.25] [--s3] [--out FILE.jsonl]
The bench state at --scale 1 holds ~1.07 GB of shards per process, so the local tier of
the 4 processes takes ~8.6 GB (own copies and peer copies): the default scale is 0.25.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import common as bc

HERE = os.path.dirname(os.path.abspath(__file__))
PROCS, DEVICES = 4, 2


# ================================================================ worker side
def worker(args: argparse.Namespace) -> None:
    bc.force_cpu_devices(DEVICES)
    bc.join_jax_job(f"127.0.0.1:{args.port}", PROCS, args.pid)
    import jax

    import snapshard

    tier = snapshard.LocalTier(args.local, interval=1, max_to_keep=2, replicas=1)
    mesh = bc.mesh(2, 4)
    names = list(bc.tree_spec(args.scale))
    out: dict = {"phase": args.phase, "pid": args.pid}
    if args.phase == "save":
        tree = bc.build_tree(names, args.scale, mesh)
        with snapshard.CheckpointManager(
            args.persistent, save_interval_steps=2, local_tier=tier
        ) as m:
            for step in range(1, 6):
                t0 = time.perf_counter()
                m.save(step, tree)
                out[f"step{step}_blocking_s"] = time.perf_counter() - t0
                m.wait_until_finished()
            out["reports"] = {str(k): v.as_dict() for k, v in m.tier_reports().items()}
        with snapshard.CheckpointManager(args.persistent + "-only") as m:
            for step in (1, 2):
                t0 = time.perf_counter()
                m.save(step, tree)
                out[f"persistent_only_step{step}_blocking_s"] = time.perf_counter() - t0
                m.wait_until_finished()
    else:
        spec = bc.tree_spec(args.scale)
        target = bc.nest(
            {
                k: jax.ShapeDtypeStruct(
                    shape, bc.np_dtype(dt), sharding=bc.sharding_for(kind, mesh, False)
                )
                for k, (shape, dt, kind) in spec.items()
            }
        )
        m = snapshard.CheckpointManager(args.persistent, save_interval_steps=2, local_tier=tier)
        t0 = time.perf_counter()
        restored = jax.block_until_ready(m.restore(target=target))
        out["restore_s"] = time.perf_counter() - t0
        out["restore"] = m.last_restore.as_dict()
        out["bit_exact"] = bc.check_restored(bc.flatten(restored), args.scale)
        m.close()
    print("RESULT " + json.dumps(out), flush=True)
    # Process 0 hosts the coordination service: everyone leaves together.
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(f"bench-done-{args.phase}", 600_000)
    os._exit(0)


# ================================================================ driver side
def run_phase(phase: str, persistent: str, local: str, scale: float, timeout: float) -> list[dict]:
    port = bc.free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", phase, "--pid", str(pid), "--port", str(port),
             "--persistent", persistent, "--local", local, "--scale", str(scale)],
            cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )
        for pid in range(PROCS)
    ]  # fmt: skip
    results = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results += [
                json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")
            ]
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if len(results) != PROCS:
        raise SystemExit(f"{phase}: {len(results)} of {PROCS} processes reported")
    return results


def remove(location: str) -> None:
    if location.startswith("s3://"):
        import obstore
        from obstore.store import from_url

        bucket, _, prefix = location[5:].partition("/")
        store = from_url(f"s3://{bucket}", client_options={"allow_http": True})
        keys = [o["path"] for batch in obstore.list(store, prefix=prefix) for o in batch]
        if keys:
            obstore.delete(store, keys)
    else:
        shutil.rmtree(location, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--s3", action="store_true", help="also a persistent tier on the S3 server")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--pid", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--persistent", default="")
    ap.add_argument("--local", default="")
    args = ap.parse_args()
    if args.worker:
        args.phase = args.worker
        worker(args)
        return
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"tiers-{stamp}.jsonl")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    stores = {"filesystem": os.path.join(bc.bench_dir(), "tiers", "persistent")}
    if args.s3:
        stores["s3"] = f"s3://{bc.new_s3_bucket('snapshard-tiers')}/persistent"
    local = os.path.join(bc.bench_dir(), "tiers", "local")
    rows: list[dict] = []
    with open(out_path, "a") as out:

        def record(kind: str, store: str, r: int, results: list[dict]) -> None:
            for d in results:
                d.update(kind=kind, store=store, round=r)
                rows.append(d)
                out.write(json.dumps(d) + "\n")
            out.flush()

        for r in range(args.rounds):
            for store, persistent in stores.items():
                remove(persistent)
                remove(persistent + "-only")
                shutil.rmtree(local, ignore_errors=True)
                os.sync()
                record(
                    "save", store, r, run_phase("save", persistent, local, args.scale, args.timeout)
                )
                for kind in ("local", "peer", "persistent"):
                    if kind == "peer":
                        shutil.rmtree(os.path.join(local, "process-00002"), ignore_errors=True)
                    if kind == "persistent":
                        shutil.rmtree(local, ignore_errors=True)
                    os.sync()
                    record(
                        kind,
                        store,
                        r,
                        run_phase("restore", persistent, local, args.scale, args.timeout),
                    )
                print(f"[round {r}] {store}: done", flush=True)
            remove(local)
        for persistent in stores.values():
            remove(persistent)
            remove(persistent + "-only")
    table(rows, args.scale)
    print(f"\nresults: {out_path}")


def table(rows: list[dict], scale: float) -> None:
    med = statistics.median
    by: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for d in rows:
        by[d["kind"], d["store"]].append(d)
    print(
        f"\n## Multi-tier, 4 processes x 2 devices, {bc.payload_bytes(scale) / 1e9:.2f} GB state (medians over rounds)\n"
    )
    print(
        "| restore from | persistent store | restore s (slowest process) | tier used | bytes from peers | bytes read from persistent | bit-exact |"
    )
    print("|---|---|---|---|---|---|---|")
    for (kind, store), ds in sorted(by.items()):
        if kind == "save":
            continue
        per_round: dict[int, list[dict]] = defaultdict(list)
        for d in ds:
            per_round[d["round"]].append(d)
        slowest = med(max(x["restore_s"] for x in v) for v in per_round.values())
        tiers = sorted({x["restore"]["tier"] for x in ds})
        peers = max(x["restore"]["bytes_from_peers"] for x in ds)
        persistent = max(x["restore"]["bytes_read_persistent"] for x in ds)
        exact = all(x["bit_exact"] for x in ds)
        print(
            f"| {kind} | {store} | {slowest:.2f} | {', '.join(tiers)} | {peers:,} | {persistent:,} | {exact} |"
        )
    print(
        "\n| save step (blocking, slowest process) | persistent store | seconds | local bytes / process | persistent bytes / process |"
    )
    print("|---|---|---|---|---|")
    for (kind, store), ds in sorted(by.items()):
        if kind != "save":
            continue
        per_round = defaultdict(list)
        for d in ds:
            per_round[d["round"]].append(d)

        def slow(key: str, rounds=per_round) -> float:
            return med(max(x[key] for x in v) for v in rounds.values())

        rep = [x["reports"] for x in ds]
        local_b = med(x["4"].get("local_bytes", 0) for x in rep)
        pers_b = med(x["4"].get("persistent_bytes", 0) for x in rep)
        local_only = med([slow("step3_blocking_s"), slow("step5_blocking_s")])
        both = med([slow("step2_blocking_s"), slow("step4_blocking_s")])
        print(f"| local tier only (steps 3, 5) | {store} | {local_only:.3f} | {local_b:,.0f} | - |")
        print(
            f"| both tiers (steps 2, 4) | {store} | {both:.3f} | {local_b:,.0f} | {pers_b:,.0f} |"
        )
        print(
            f"| persistent tier only (no local tier) | {store} | {slow('persistent_only_step2_blocking_s'):.3f} | - | {pers_b:,.0f} |"
        )


if __name__ == "__main__":
    main()
