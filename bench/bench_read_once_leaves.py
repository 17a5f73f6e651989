"""Read-once restore of a state of many small arrays: time with read-once on and off.

2 processes x 2 CPU devices (jax.distributed on 127.0.0.1, gloo collectives). The state is
`--arrays` arrays of (`--rows`, 2) float32, saved in three shardings in turn (rows and
columns cut, columns cut, replicated) and restored onto replicated targets: every process
holds every array. With read-once each unique byte is read by one process and the arrays
move over the collectives; arrays of one kind move stacked, one collective a stack
(jax/read_once.py), where a program with an output per array compiled for a time that grew
faster than its arrays. The first restore of each mode (its compilation) is reported
apart; the restore's time is the slower process's.

usage: python bench/bench_read_once_leaves.py [--arrays 3000] [--rows 4] [--rounds 3]
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

import common as bc

PROCS, DEVICES = 2, 2


def worker(args: argparse.Namespace) -> None:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    from snapshard import ReadOptions
    from snapshard.coordination import default_coordinator

    pid = int(os.environ["BENCH_ROL_PID"])
    bc.join_jax_job(f"127.0.0.1:{os.environ['BENCH_ROL_PORT']}", PROCS, pid, timeout_s=120)
    mesh = jax.make_mesh((PROCS, DEVICES), ("data", "model"))
    specs = [P("data", "model"), P(None, "model"), P()]
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((args.rows, 2)).astype(np.float32) for _ in range(args.arrays)]

    def put(i: int) -> jax.Array:
        s = NamedSharding(mesh, specs[i % 3])
        return jax.make_array_from_callback(data[i].shape, s, lambda ix: data[i][ix])

    path = os.path.join(args.dir, "ck")
    snapshard.save(path, {f"a{i}": put(i) for i in range(args.arrays)}, overwrite=True)
    rep = NamedSharding(mesh, P())
    target = {
        f"a{i}": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep) for i, x in enumerate(data)
    }
    for rnd in range(args.rounds):
        for mode in ("on", "off") if rnd % 2 == 0 else ("off", "on"):
            default_coordinator().barrier(f"rol/{rnd}/{mode}", 300)
            t0 = time.perf_counter()
            got = snapshard.load(path, target, ReadOptions(read_once=mode == "on"))
            jax.block_until_ready(got)
            seconds = time.perf_counter() - t0
            ok = all(
                np.array_equal(np.asarray(s.data), data[int(k[1:])][s.index])
                for k in ("a0", f"a{args.arrays - 1}") for s in got[k].addressable_shards
            )  # fmt: skip
            del got
            bc.emit(round=rnd, mode=mode, seconds=seconds, ok=ok, pid=pid)


def run(args: argparse.Namespace) -> list[dict]:
    port = bc.free_port()
    procs = []
    for pid in range(PROCS):
        env = dict(os.environ)
        env.update(
            BENCH_ROL_PID=str(pid), BENCH_ROL_PORT=str(port), JAX_PLATFORMS="cpu",
            OMP_NUM_THREADS="1", XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}",
        )  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arrays",
               str(args.arrays), "--rows", str(args.rows), "--rounds", str(args.rounds),
               "--dir", args.dir]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=args.timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"a worker exited {p.returncode}:\n{err[-4000:]}")
    return [json.loads(line[7:]) for out, _ in outs for line in out.splitlines()
            if line.startswith("RESULT ")]  # fmt: skip


def report(rows: list[dict], arrays: int) -> None:
    slowest: dict[tuple[int, str], float] = {}
    for r in rows:
        key = (r["round"], r["mode"])
        slowest[key] = max(slowest.get(key, 0.0), r["seconds"])
    print(f"\n{arrays} arrays, {PROCS} processes x {DEVICES} devices, replicated targets")
    print("| read-once | first restore s | later restores s, median [min-max] |")
    print("|---|---|---|")
    for mode in ("on", "off"):
        later = [s for (rnd, m), s in sorted(slowest.items()) if m == mode and rnd > 0]
        print(f"| {mode} | {slowest[(0, mode)]:.3f} | {bc.spread(later, 3) if later else '-'} |")
    rounds = sorted({rnd for rnd, _ in slowest if rnd > 0})
    paired = [slowest[(k, "on")] / slowest[(k, "off")] for k in rounds]
    if paired:
        print(f"time on / off, paired per round after the first: {statistics.median(paired):.2f}")
    print("every restore bit-exact:", all(r["ok"] for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(dir=bc.bench_dir()) as d:
        args.dir = args.dir or d
        report(run(args), args.arrays)


if __name__ == "__main__":
    main()
