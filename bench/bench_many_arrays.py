"""Save and restore of a state of many small arrays, where the cost per array, not the bytes,
sets the time: snapshard.torch against torch.distributed.checkpoint (DCP), and snapshard
against Orbax, on the same arrays.

Each round runs one fresh process per library, in an order rotated by the round. A process
makes N float32 arrays (default 1000 of 64 x 64, 16 MiB in all: a model's norms, biases and
small projections, times the optimizer's moments), then saves (durable: fsync'd) and
restores them `--repeats` + 1 times; the first of each is reported apart (what a restart
pays: imports, thread pools, first allocations), the others as their median. Restores go
into preallocated targets (torch: `empty_like` tensors in place; JAX: ShapeDtypeStructs on
the arrays' sharding) and are checked bit-exact.

    python bench/bench_many_arrays.py --rounds 3 [--arrays 1000] [--repeats 3]

Prints medians over rounds and the ratios peer / snapshard paired per round; writes the
results as JSON lines (--out, default bench/results/many-arrays-<time>.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc

LIBRARIES = ("snap_torch", "dcp", "snap_jax", "orbax")


def _arrays(n: int, side: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return {f"layers.{i:04d}.w": rng.standard_normal((side, side), np.float32) for i in range(n)}


def _job(lib: str, n: int, side: int, repeats: int) -> None:
    """One library in this (fresh) process: `repeats` + 1 saves and restores."""
    import numpy as np

    host = _arrays(n, side)
    root = bc.ckpt_dir(f"many-{lib}")
    bc.fresh_dir(root)
    os.makedirs(root, exist_ok=True)
    if lib in ("snap_torch", "dcp"):
        import torch

        state = {k: torch.from_numpy(v) for k, v in host.items()}
        target = {k: torch.empty_like(v) for k, v in state.items()}
        if lib == "snap_torch":
            import snapshard.torch as st

            def save(path: str) -> None:
                st.save(path, state)

            def load(path: str) -> None:
                st.load(path, target)
        else:
            import torch.distributed.checkpoint as dcp

            def save(path: str) -> None:  # sync_files=True (DCP's default): durable
                dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)

            def load(path: str) -> None:
                dcp.load(target, checkpoint_id=path, no_dist=True)

        def check() -> bool:
            return all(np.array_equal(target[k].numpy(), host[k]) for k in host)
    else:
        import jax

        state = {k: jax.device_put(v) for k, v in host.items()}
        abstract = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
            for k, v in state.items()
        }
        out: dict[str, Any] = {}
        if lib == "snap_jax":
            import snapshard

            def save(path: str) -> None:
                snapshard.save(path, state)

            def load(path: str) -> None:
                out.update(snapshard.load(path, abstract))
        else:
            import orbax.checkpoint as ocp

            ckptr = ocp.StandardCheckpointer()

            def save(path: str) -> None:  # durable by default: TensorStore fsyncs its files
                ckptr.save(path, state)
                ckptr.wait_until_finished()

            def load(path: str) -> None:
                out.update(ckptr.restore(path, abstract))

        def check() -> bool:
            return all(np.array_equal(np.asarray(out[k]), host[k]) for k in host)

    saves, loads = [], []
    ok = True
    for r in range(repeats + 1):
        path = os.path.join(root, f"step_{r}")
        t = time.perf_counter()
        save(path)
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        load(path)
        loads.append(time.perf_counter() - t)
        ok = ok and check()
        bc.remove(path)
    bc.remove(root)
    bc.emit(
        lib=lib, arrays=n, side=side, first_save_s=saves[0], first_load_s=loads[0],
        save_s=statistics.median(saves[1:]), load_s=statistics.median(loads[1:]), exact=ok,
    )  # fmt: skip


def _run(lib: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--job", lib, "--arrays", str(args.arrays),
           "--side", str(args.side), "--repeats", str(args.repeats)]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[7:]))
    raise RuntimeError(f"{lib} job failed:\n{p.stderr[-3000:]}")


def _report(rows: list[dict[str, Any]]) -> None:
    by = {lib: [r for r in rows if r["lib"] == lib] for lib in LIBRARIES}
    keys = ("first_save_s", "first_load_s", "save_s", "load_s")
    n = rows[0]["arrays"]
    print(f"\n## {n} arrays of {rows[0]['side']}x{rows[0]['side']} float32, medians over rounds\n")
    print("| library | first save | first restore | save | restore | bit-exact |")
    print("|---|---|---|---|---|---|")
    for lib, rs in by.items():
        cells = [bc.spread([r[k] for r in rs], 3) for k in keys]
        print(f"| {lib} | " + " | ".join(cells) + f" | {all(r['exact'] for r in rs)} |")
    checks = []
    for peer, ours in (("dcp", "snap_torch"), ("orbax", "snap_jax")):
        for k in keys:
            ratios = [p[k] / o[k] for p, o in zip(by[peer], by[ours], strict=True)]
            checks.append((f"{peer} / {ours}, {k[:-2].replace('_', ' ')}", ratios, ""))
    bc.ratio_table("Ratios, peer / snapshard (paired by round; > 1: snapshard faster)", checks)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arrays", type=int, default=1000)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default=",".join(LIBRARIES))
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument("--job", choices=LIBRARIES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        _job(args.job, args.arrays, args.side, args.repeats)
        return
    libs = [x for x in args.only.split(",") if x]
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"many-arrays-{time.strftime('%Y%m%d-%H%M%S')}.jsonl",
    )  # fmt: skip
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows = []
    for r in range(args.rounds):
        for lib in libs[r % len(libs) :] + libs[: r % len(libs)]:
            row = _run(lib, args) | {"round": r}
            rows.append(row)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"round {r} {lib}: save {row['save_s']:.3f} s, load {row['load_s']:.3f} s",
                  flush=True)  # fmt: skip
    rows.sort(key=lambda x: (x["round"], x["lib"]))
    if set(libs) == set(LIBRARIES):
        _report(rows)


if __name__ == "__main__":
    main()
