"""Many small arrays restored by several processes from an object store: read-once off, by
default, and on (`ReadOptions(read_once=False / None / True)`), side by side.

2 processes. JAX: jax.distributed on 127.0.0.1, 4 CPU devices each, gloo collectives;
N arrays of 64x16 float32, every other one sharded over the 8 devices, the others
replicated. torch: 2 gloo ranks, N DTensors of 64x16 float32, every other one Shard(0),
the others Replicate(). The state is saved once to the store, then each round restores it
in every mode, in an order rotated by the round, behind a barrier; a restore's time is the
slower process's. Every restore is checked bit-exact on the first 100 leaves.

The store: `--url`, else a new bucket on the local S3 server when AWS_ENDPOINT_URL is set
(`.ci/run` shows how to start it and which AWS_* variables to export), else a local
directory (where the default turns read-once off).

usage: python bench/bench_store_many_arrays.py [--arrays 10000] [--rounds 3]
                                               [--framework jax,torch] [--url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import common as bc

PROCS = 2
MODES = {"off": False, "default": None, "on": True}


# ================================================================ worker side
def _jax_job(args: argparse.Namespace, pid: int) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from jax.experimental.multihost_utils import sync_global_devices
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    bc.join_jax_job(f"127.0.0.1:{args.port}", PROCS, pid)
    block = np.random.default_rng(0).standard_normal((args.arrays, 64, 16), np.float32)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    cut, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    state = {
        f"{i:06d}": jax.make_array_from_callback(
            block[i].shape, cut if i % 2 == 0 else whole, block[i].__getitem__
        )
        for i in range(args.arrays)
    }
    snapshard.save(args.url, state)
    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }

    def exact(out: dict[str, Any]) -> bool:
        return all(
            np.array_equal(np.asarray(s.data), block[int(k)][s.index])
            for k in list(out)[:100]
            for s in out[k].addressable_shards
        )

    _rounds(args, pid, lambda ro: snapshard.load(args.url, abstract, options=_opts(ro)),
            exact, sync_global_devices)  # fmt: skip
    jax.distributed.shutdown()


def _torch_job(args: argparse.Namespace, pid: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import snapshard.torch as st

    dist.init_process_group("gloo", rank=pid, world_size=PROCS)
    mesh = init_device_mesh("cpu", (PROCS,))
    full = torch.from_numpy(
        np.random.default_rng(0).standard_normal((args.arrays, 64, 16), np.float32)
    )

    def make(fill: bool) -> dict[str, Any]:
        out = {}
        for i in range(args.arrays):
            if i % 2 == 0:
                local = full[i].chunk(PROCS)[pid].clone() if fill else torch.zeros(32, 16)
                out[f"{i:06d}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            else:
                local = full[i].clone() if fill else torch.zeros(64, 16)
                out[f"{i:06d}"] = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        return out

    state = make(True)
    st.save(args.url, state)

    def load(ro: bool | None) -> dict[str, Any]:
        target = make(False)
        st.load(args.url, target, options=_opts(ro))
        return target

    def exact(out: dict[str, Any]) -> bool:
        return all(torch.equal(out[k].to_local(), state[k].to_local()) for k in list(out)[:100])

    _rounds(args, pid, load, exact, lambda name: dist.barrier())
    dist.barrier()  # (a rank that tears down while the other still talks aborts)
    dist.destroy_process_group()


def _opts(read_once: bool | None) -> Any:
    from snapshard import ReadOptions

    return ReadOptions(read_once=read_once)


def _rounds(args: argparse.Namespace, pid: int, load: Any, exact: Any, sync: Any) -> None:
    """Every mode each round, rotated, behind a barrier; one JSON line per restore."""
    names = list(MODES)
    for r in range(args.rounds):
        for mode in names[r % len(names) :] + names[: r % len(names)]:
            sync(f"{r}-{mode}")
            t = time.perf_counter()
            out = load(MODES[mode])
            took = time.perf_counter() - t
            print(json.dumps({"round": r, "mode": mode, "pid": pid, "s": took,
                              "exact": bool(exact(out))}), flush=True)  # fmt: skip
            del out


# ================================================================ parent side
def run(framework: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    port = bc.free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--port", str(port),
           "--arrays", str(args.arrays), "--rounds", str(args.rounds), "--url",
           f"{args.url}/{framework}"]  # fmt: skip
    procs = [
        subprocess.Popen([*cmd, "--pid", str(p)], stdout=subprocess.PIPE, text=True)
        for p in range(PROCS)
    ]
    rows = []
    for p in procs:
        out, _ = p.communicate(timeout=args.timeout)
        if p.returncode:
            raise SystemExit(f"{framework} worker failed ({p.returncode})")
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows


def report(framework: str, rows: list[dict[str, Any]]) -> None:
    slowest: dict[tuple[int, str], float] = {}
    for x in rows:
        key = (x["round"], x["mode"])
        slowest[key] = max(slowest.get(key, 0.0), x["s"])
    rounds = sorted({r for r, _ in slowest})
    print(f"\n## {framework}: restore seconds, slower process, medians over {len(rounds)} rounds")
    print("\n| read_once | restore | / off |\n|---|---|---|")
    for mode in MODES:
        s = [slowest[(r, mode)] for r in rounds]
        ratio = [slowest[(r, mode)] / slowest[(r, "off")] for r in rounds]
        print(f"| {mode} ({MODES[mode]}) | {bc.spread(s)} | {bc.spread(ratio)} |")
    print(f"\nbit-exact: {all(x['exact'] for x in rows)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arrays", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--framework", default="jax,torch")
    ap.add_argument("--url", default=None)
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pid", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        (_jax_job if args.worker == "jax" else _torch_job)(args, args.pid)
        return
    local = None
    if args.url is None and os.environ.get("AWS_ENDPOINT_URL"):
        args.url = f"s3://{bc.new_s3_bucket()}/many"
    elif args.url is None:
        local = args.url = os.path.join(bc.bench_dir(), "store_many_arrays")
        bc.fresh_dir(local)
    print(f"{args.arrays} arrays of 64x16 float32 on {PROCS} processes, from {args.url}")
    for framework in args.framework.split(","):
        report(framework, run(framework, args))
    if local:
        bc.remove(local)


if __name__ == "__main__":
    main()
