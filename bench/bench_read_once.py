"""Read-once restore: bytes read from storage and restore time with read-once on and off.

4 processes x 2 CPU devices (jax.distributed on 127.0.0.1, gloo collectives). The state is
saved on mesh (data=4, model=2) with P('data', 'model') and restored onto the same mesh
with P(None, 'model'): every column band then lives on all 4 processes, so without
read-once the job reads 4x the unique bytes. Storages: the local disk (page cache warm, and
evicted with posix_fadvise before each restore) and, when AWS_ENDPOINT_URL is set, the
local S3 server (`.ci/run` shows how to start it and which AWS_* variables to export).

One set of worker processes serves every round: in each round every mode runs (read-once
on and off; for torch also on through the all-to-all rather than shared memory, where the
processes share a host), in an order rotated between rounds, each behind a barrier (not
counted); a restore's time is the slowest process's, its bytes the sum over processes. The first restore of each mode in a
job also compiles the resharding program; the first round is reported apart.

With `--framework torch`: the same state as torch DTensors over 4 gloo ranks, saved
Shard(0) and restored onto Replicate() (every rank holds every tensor whole), through
snapshard.torch.

With `--target cols`: a reshard that cuts the saved rows, each box on one process. JAX:
restored onto P(None, 'model') of a mesh (1, 8), columns cut 8 ways where they were saved
cut 2 ways (without read-once the job reads 2x the unique bytes); torch: restored onto
Shard(1) (4x). With read-once, bands of whole rows are read once and exchanged.

usage: python bench/bench_read_once.py [--mb 512] [--rounds 5] [--framework jax|torch]
                                       [--target replicated|cols] [--out FILE.jsonl]
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

import common as bc
from snapshard import ReadOptions

HERE = os.path.dirname(os.path.abspath(__file__))
PROCS, DEVICES = 4, 2
N_ARRAYS, COLS = 8, 1024
# "on, collective": torch bands through the all-to-all instead of shared memory
MODES = {"jax": ["on", "off"], "torch": ["on", "off", "on, collective"]}


# ================================================================ worker side
def _init() -> tuple[int, int]:
    pid = int(os.environ["BENCH_RO_PID"])
    bc.join_jax_job(f"127.0.0.1:{os.environ['BENCH_RO_PORT']}", PROCS, pid, timeout_s=120)
    return pid, PROCS


def _rows(mb: int) -> int:
    return max(8, (mb << 20) // (N_ARRAYS * COLS * 4) // 8 * 8)


def _host(i: int, rows: int):
    import numpy as np

    return (np.arange(rows * COLS, dtype=np.float32).reshape(rows, COLS) + i * 0.5) * 1e-3


def _measure(args, pid: int, n: int, unique: int, save, restore, sync, put, get) -> None:
    """The rounds of one worker, JAX's or torch's: per storage, save, then per round both
    modes in alternating order, each behind `sync`; process 0 emits the job's row.
    `restore(loc, mode, check)` returns (seconds, ReadStats, bit-exact); MODES[framework]
    lists the modes, whose order rotates from round to round."""
    storages = [("local", os.path.join(args.dir, "ckpt"))]
    if args.s3:
        storages.append(("s3", args.s3))
    for where, loc in storages:
        sync(f"save-{where}")
        save(loc)
        variants = [("warm", False)] if where == "s3" else [("warm", False), ("evicted", True)]
        for cache, evict in variants:
            for r in range(args.rounds):
                modes = MODES[args.framework]
                for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                    if evict and pid == 0:
                        bc.evict(loc)
                    sync(f"{where}-{cache}-{r}-{mode}")
                    dt, stats, ok = restore(loc, mode, r == 0)
                    key = f"bench_ro/res/{where}/{cache}/{r}/{mode}"
                    mine = {"s": dt, "read": stats.bytes_read, "peers": stats.bytes_from_peers,
                            "reshard_s": stats.reshard_s, "ok": bool(ok)}  # fmt: skip
                    put(f"{key}/{pid}", json.dumps(mine))
                    if pid == 0:
                        got = [json.loads(get(f"{key}/{q}")) for q in range(n)]
                        bc.emit(
                            framework=args.framework, storage=where, cache=cache, round=r,
                            mode=mode, read_once=mode != "off", unique=unique,
                            seconds=max(g["s"] for g in got),
                            bytes_read=sum(g["read"] for g in got),
                            bytes_from_peers=sum(g["peers"] for g in got),
                            reshard_s=max(g["reshard_s"] for g in got),
                            ok=all(g["ok"] for g in got),
                        )  # fmt: skip
    sync("done")


def worker(args: argparse.Namespace) -> None:
    pid, n = _init()
    import gc

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    from snapshard.coordination import default_coordinator
    from snapshard.jax import distributed  # noqa: F401  (the JAX wing: jax.distributed's coordinator the default)

    coord = default_coordinator()
    rows = _rows(args.mb)
    mesh = Mesh(np.array(jax.devices()).reshape(n, -1), ("data", "model"))
    save_s = NamedSharding(mesh, P("data", "model"))
    if args.target == "cols":
        target_s = NamedSharding(
            Mesh(mesh.devices.reshape(1, -1), mesh.axis_names), P(None, "model")
        )
    else:
        target_s = NamedSharding(mesh, P(None, "model"))
    refs = {f"w{i}": _host(i, rows) for i in range(N_ARRAYS)}
    tree = {
        k: jax.make_array_from_callback(v.shape, save_s, lambda idx, v=v: v[idx])
        for k, v in refs.items()
    }
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=target_s) for k, v in refs.items()}
    seq = 0

    def sync(name: str) -> None:
        nonlocal seq
        seq += 1
        coord.barrier(f"bench_ro/{seq}/{name}", 600)

    def restore(loc: str, mode: str, check: bool):
        stats = snapshard.ReadStats()
        t0 = time.perf_counter()
        out = snapshard.load(loc, target, ReadOptions(read_once=mode == "on"), stats=stats)
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        ok = True
        if check:
            for k, x in out.items():
                ok &= x.sharding == target_s
                for s in x.addressable_shards:
                    ok &= np.asarray(s.data).tobytes() == refs[k][s.index].tobytes()
        del out
        gc.collect()
        return dt, stats, ok

    _measure(
        args, pid, n, sum(v.nbytes for v in refs.values()),
        lambda loc: snapshard.save(loc, tree, overwrite=True), restore, sync,
        coord.set, lambda key: coord.get(key, 600),
    )  # fmt: skip
    os._exit(0)


def torch_worker(args: argparse.Namespace) -> None:
    """The same state as torch DTensors: saved Shard(0) over the 4 ranks, restored onto
    Replicate() (every rank holds every tensor whole: 4x the unique bytes without
    read-once)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import snapshard
    import snapshard.torch as st
    from snapshard.coordination import peer_memory

    pid = int(os.environ["BENCH_RO_PID"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_RO_PORT']}", rank=pid,
        world_size=PROCS, timeout=timedelta(seconds=600),
    )  # fmt: skip
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (PROCS,))
    rows = _rows(args.mb)
    refs = {f"w{i}": torch.from_numpy(_host(i, rows)) for i in range(N_ARRAYS)}
    saved = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in refs.items()}
    place = [Shard(1)] if args.target == "cols" else [Replicate()]
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, place) for k, v in refs.items()}
    store = dist.distributed_c10d._get_default_store()
    mine = {k: v.chunk(PROCS, dim=1)[pid] if args.target == "cols" else v for k, v in refs.items()}

    def restore(loc: str, mode: str, check: bool):
        for t in target.values():
            t.to_local().zero_()
        peer_memory.ENABLED = mode != "on, collective"
        stats = snapshard.ReadStats()
        t0 = time.perf_counter()
        st.load(loc, target, ReadOptions(read_once=mode != "off"), stats=stats)
        dt = time.perf_counter() - t0
        ok = not check or all(torch.equal(target[k].to_local(), mine[k]) for k in refs)
        return dt, stats, ok

    _measure(
        args, pid, PROCS, sum(v.numel() * 4 for v in refs.values()),
        lambda loc: st.save(loc, saved, overwrite=True), restore,
        lambda name: dist.barrier(), lambda k, v: store.set(k, v),
        lambda key: store.get(key).decode(),
    )  # fmt: skip
    dist.destroy_process_group()


# ================================================================ driver side
def run_job(args: argparse.Namespace, out: str) -> list[dict]:
    port = bc.free_port()
    procs = []
    for pid in range(PROCS):
        env = dict(os.environ)
        env.update(
            BENCH_RO_PID=str(pid), BENCH_RO_PORT=str(port), JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
            LOCAL_WORLD_SIZE=str(PROCS),  # as torchrun sets it: the processes share the CPUs
        )  # fmt: skip
        cmd = [sys.executable, os.path.join(HERE, "bench_read_once.py"), "--worker",
               "--mb", str(args.mb), "--rounds", str(args.rounds), "--dir", args.dir,
               "--framework", args.framework, "--target", args.target]  # fmt: skip
        if args.s3:
            cmd += ["--s3", args.s3]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    rows = []
    try:
        stdout, stderr = procs[0].communicate(timeout=args.timeout)
        for p in procs[1:]:
            p.communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if procs[0].returncode != 0:
        raise SystemExit(f"worker 0 exited {procs[0].returncode}:\n{stderr[-4000:]}")
    with open(out, "a") as f:
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                rows.append(json.loads(line[7:]))
                f.write(line[7:] + "\n")
    return rows


def report(rows: list[dict]) -> None:
    print("\n| storage | page cache | read-once | restore s, median [min-max] (first round) "
          "| bytes read / unique | from peers / unique | ok |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, str], dict[bool, list[dict]]] = {}
    for r in rows:
        mode = r.get("mode", "on" if r["read_once"] else "off")  # (rows of older runs)
        groups.setdefault((r["storage"], r["cache"]), {}).setdefault(mode, []).append(r)
    ratios = []
    for (where, cache), by_mode in groups.items():
        for mode in by_mode:
            rs = sorted(by_mode[mode], key=lambda r: r["round"])
            if not rs:
                continue
            later = [r["seconds"] for r in rs[1:]] or [rs[0]["seconds"]]
            u = rs[0]["unique"]
            print(
                f"| {where} | {cache} | {mode} | {bc.spread(later, 3)} "
                f"({rs[0]['seconds']:.3f}) | {statistics.median(r['bytes_read'] for r in rs) / u:.3f} "
                f"| {statistics.median(r['bytes_from_peers'] for r in rs) / u:.3f} "
                f"| {all(r['ok'] for r in rs)} |"
            )
        on = {r["round"]: r["seconds"] for r in by_mode.get("on", [])}
        for other in [m for m in by_mode if m != "on"]:
            them = {r["round"]: r["seconds"] for r in by_mode[other]}
            paired = [them[k] / on[k] for k in sorted(on) if k in them and k > 0]
            ratios.append(
                (f"{where}, {cache}: time {other} / on (rounds after the first)", paired, "")
            )
    bc.ratio_table("Speed-up of read-once, paired per round", ratios)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=512, help="state size in MiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--analyze", default=None)
    ap.add_argument("--s3", default=None, help="s3:// URL (default: a new bucket when "
                    "AWS_ENDPOINT_URL is set)")  # fmt: skip
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--dir", default=os.path.join(bc.bench_dir(), "read_once"))
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--framework", choices=("jax", "torch"), default="jax")
    ap.add_argument("--target", choices=("replicated", "cols"), default="replicated")
    args = ap.parse_args()
    if args.worker:
        (torch_worker if args.framework == "torch" else worker)(args)
        return
    if args.analyze:
        with open(args.analyze) as f:
            report([json.loads(line) for line in f if line.strip()])
        return
    if args.s3 is None and not args.no_s3 and os.environ.get("AWS_ENDPOINT_URL"):
        args.s3 = f"s3://{bc.new_s3_bucket()}/read-once"
    os.makedirs(args.dir, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(HERE, "results", f"read_once-{stamp}.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = run_job(args, out)
    shape = (
        f"{PROCS} ranks" if args.framework == "torch" else f"{PROCS} processes x {DEVICES} devices"
    )
    print(f"{len(rows)} restores ({args.framework}); {args.mb} MiB state, {shape}")
    report(rows)
    bc.remove(args.dir)


if __name__ == "__main__":
    main()
