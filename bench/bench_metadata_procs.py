"""Metadata bytes each restoring process reads, format v1 against v2, on real processes.

4 processes x 2 CPU devices save a 2,000-array tree (mesh (data=2, model=4); arrays sharded
over `model`, replicated over `data`) and restore it onto the same mesh. v1 is the library
as of the commit given by --v1-rev (its code is taken from git into a temporary directory);
v2 is the working tree. Each process reports the manifest bytes it parsed, the chunk-record
bytes it fetched (v2), and its restore time.

    python bench_metadata_procs.py [--arrays 2000] [--rounds 3] [--v1-rev 30e3f53]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import free_port, library_at, worker_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKER = r"""
import json, os, sys, time
pid, n, port, ckpt, arrays, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=n, process_id=pid)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import snapshard
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
sh = NamedSharding(mesh, P(None, "model"))
shape = (16, 64)
if mode == "save":
    tree = {f"layer{i:04d}": jax.make_array_from_callback(shape, sh, lambda idx, i=i: np.full(shape, i, np.float32)[idx]) for i in range(arrays)}
    snapshard.save(ckpt, tree, overwrite=True)
    print("RESULT " + json.dumps({"ok": True}), flush=True)
else:
    target = {f"layer{i:04d}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sh) for i in range(arrays)}
    stats = snapshard.ReadStats()
    t0 = time.perf_counter()
    out = snapshard.load(ckpt, target, stats=stats)
    dt = time.perf_counter() - t0
    manifest = os.path.getsize(os.path.join(ckpt, "manifest.json"))
    ok = all(float(np.asarray(out[k].addressable_shards[0].data).ravel()[0]) == int(k[5:]) for k in out)
    print("RESULT " + json.dumps({"ok": ok, "manifest": manifest, "records": getattr(stats, "metadata_bytes", 0),
                                  "data": stats.bytes_read, "needed": stats.bytes_needed, "s": dt}), flush=True)
"""


def run(src: str, mode: str, ckpt: str, arrays: int) -> list[dict]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=src, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu")  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(i), "4", str(port), ckpt, str(arrays), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    return worker_results(procs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--v1-rev", default="30e3f53")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"v1": library_at(args.v1_rev, tmp), "v2": os.path.join(ROOT, "src")}
        rows = {}
        for name, src in sources.items():
            ckpt = os.path.join(tmp, f"ckpt-{name}")
            run(src, "save", ckpt, args.arrays)
            rounds = [run(src, "restore", ckpt, args.arrays) for _ in range(args.rounds)]
            assert all(r["ok"] for rs in rounds for r in rs), "restore mismatch"
            last = rounds[-1]
            rows[name] = {
                "manifest": last[0]["manifest"],
                "records": statistics.median(r["records"] for r in last),
                "data": statistics.median(r["data"] for r in last),
                "s": statistics.median(max(r["s"] for r in rs) for rs in rounds),
            }
    print(f"\n4 processes x 2 CPU devices, {args.arrays} arrays, restore onto the same mesh "
          f"(median of {args.rounds} rounds; per process)\n")  # fmt: skip
    print(
        "| format | manifest bytes | chunk-record bytes | metadata bytes read | data bytes read | restore s |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        meta = r["manifest"] + r["records"]
        print(
            f"| {name} | {r['manifest']:,} | {int(r['records']):,} | {int(meta):,} | {int(r['data']):,} | {r['s']:.3f} |"
        )
    v1, v2 = (rows[k]["manifest"] + rows[k]["records"] for k in ("v1", "v2"))
    print(f"\nv2 reads {v2 / v1:.3f}x the metadata bytes of v1 ({time.strftime('%Y-%m-%d')})")


if __name__ == "__main__":
    main()
