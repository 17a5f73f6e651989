"""Incremental saves and per-block compression, side by side in one run.

1. Adapter fine-tuning: the peer-bench state (`--scale`, 1.0 = 2.0 GiB) is frozen; trainable
   adapters (low-rank A and B per weight, f32, with their two Adam moments) make up about
   5% of the bytes. Two managed saves (steps 1 and 2, the adapters changed in between), once
   with a plain CheckpointManager and once with `incremental=True`: bytes written, save
   time (blocking and total), then an evicted restore of step 2 from each. Also step 2 of an
   incremental save through content hashes alone (`save(base=...)` with equal but new
   arrays, so the identity shortcut does not apply).
2. Compression on the peer-bench state and on a bf16-parameters + f32-Adam-moments state:
   stored bytes and save / evicted-restore throughput for no codec, zstd with and without
   the byte shuffle.

usage: python bench/bench_incremental.py [--scale 0.1] [--rank 8] [--skip-compression]
Prints one `RESULT {json}` line per measurement and a summary table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import (
    ckpt_dir,
    du_bytes,
    emit,
    evict,
    force_cpu_devices,
    fresh_dir,
    make_array,
    settle,
    tree_spec,
)

force_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import snapshard  # noqa: E402
from snapshard import SaveOptions  # noqa: E402
from snapshard.format import compression  # noqa: E402


def frozen_state(scale: float, m) -> dict:
    from common import build_tree

    return build_tree(list(tree_spec(scale)), scale, m)


def adapters(scale: float, rank: int, step: int, m) -> dict:
    """LoRA-style A (rows x r) and B (r x cols) per frozen weight, plus Adam moments."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sh = NamedSharding(m, P())
    out = {}
    for name, (shape, _, kind) in tree_spec(scale).items():
        if kind != "w":
            continue
        rng = np.random.default_rng([step, len(out)])
        for part, s in (("a", (shape[0], rank)), ("b", (rank, shape[1]))):
            for slot in ("p", "mu", "nu"):
                x = (rng.standard_normal(s, dtype=np.float32) * 0.01).astype(np.float32)
                out[f"{name}.{part}.{slot}"] = jax.device_put(x, sh)
    return out


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def managed_pair(root: str, frozen: dict, ad1: dict, ad2: dict, incremental: bool) -> dict:
    fresh_dir(root)
    res = {}
    with snapshard.CheckpointManager(root, incremental=incremental) as mgr:
        for step, ad in ((1, ad1), (2, ad2)):
            settle()
            t0 = time.perf_counter()
            mgr.save(step, {"frozen": frozen, "adapter": ad, "step": step})
            t1 = time.perf_counter()
            mgr.wait_until_finished()
            t2 = time.perf_counter()
            rep = mgr.tier_reports()[step]
            res[step] = {
                "blocking_s": t1 - t0,
                "total_s": t2 - t0,
                "bytes_written": int(rep.persistent_bytes),
            }
    return res


def evicted_restore(path: str, target) -> float:
    for d in {path, os.path.join(os.path.dirname(path), "1")}:
        if os.path.isdir(d):
            evict(d)
    t0 = time.perf_counter()
    out = snapshard.load(path, target)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    del out
    return dt


def bench_incremental(args, m) -> list[tuple[str, float, str]]:
    frozen = frozen_state(args.scale, m)
    ad1 = adapters(args.scale, args.rank, 1, m)
    ad2 = adapters(args.scale, args.rank, 2, m)
    total = nbytes(frozen) + nbytes(ad1)
    emit(what="state", frozen_bytes=nbytes(frozen), adapter_bytes=nbytes(ad1),
         frozen_share=nbytes(frozen) / total)  # fmt: skip
    full = managed_pair(ckpt_dir("incr-full"), frozen, ad1, ad2, incremental=False)
    inc = managed_pair(ckpt_dir("incr-inc"), frozen, ad1, ad2, incremental=True)
    for name, r in (("full", full), ("incremental", inc)):
        for step, v in r.items():
            emit(what="managed save", mode=name, step=step, **v)
    # content hashes only: equal values in new arrays (no identity shortcut)
    copy = jax.tree.map(lambda x: jnp.array(x, copy=True), frozen)
    jax.block_until_ready(copy)
    hashed_dir = ckpt_dir("incr-inc") + "/2h"
    settle()
    t0 = time.perf_counter()
    t = snapshard.save(
        hashed_dir, {"frozen": copy, "adapter": ad2, "step": 2}, base=ckpt_dir("incr-inc") + "/1"
    )
    hashed_s = time.perf_counter() - t0
    emit(what="hash-only incremental save", total_s=hashed_s, blocking_s=t.blocking_s,
         bytes_written=t.bytes_written)  # fmt: skip
    del copy
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        {"frozen": frozen, "adapter": ad2},
    )
    target["step"] = 0
    r_full = evicted_restore(ckpt_dir("incr-full") + "/2", target)
    r_inc = evicted_restore(ckpt_dir("incr-inc") + "/2", target)
    emit(what="evicted restore of step 2", full_s=r_full, incremental_s=r_inc)
    f2, i2 = full[2], inc[2]
    return [
        ("step-2 bytes, incremental / full", i2["bytes_written"] / f2["bytes_written"], "<= 0.06"),
        ("step-2 save time, incremental / full", i2["total_s"] / f2["total_s"], "<= 0.15"),
        ("step-2 save time, hashes only / full", hashed_s / f2["total_s"], ""),
        ("step-2 blocking, incremental / full", i2["blocking_s"] / f2["blocking_s"], "<= 1"),
        ("step-2 restore, incremental / full", r_inc / r_full, "<= 1"),
    ]


def trained_like(scale: float) -> dict:
    """bf16 parameters with f32 Adam moments of the peer-bench shapes (synthetic: moments
    of a few hundred steps of noisy gradients, so mu is small and nu positive and smooth)."""
    import ml_dtypes

    out = {}
    for name, (shape, _, _) in list(tree_spec(scale).items())[:8]:
        rng = np.random.default_rng(len(out))
        p = rng.standard_normal(shape, dtype=np.float32) * 0.02
        g = rng.standard_normal(shape, dtype=np.float32) * 1e-3
        out[name] = {
            "p": p.astype(ml_dtypes.bfloat16),
            "mu": (0.1 * g).astype(np.float32),
            "nu": (0.001 * g * g + 1e-12).astype(np.float32),
        }
    return out


def bench_compression(args) -> list[tuple[str, float, str]]:
    states = {
        "peer-bench": {k: make_array(k, args.scale) for k in tree_spec(args.scale)},
        "bf16+adam": trained_like(args.scale),
    }
    rows = []
    for sname, state in states.items():
        base_size = None
        for option in (None, "zstd", "zstd+shuffle"):
            d = ckpt_dir(f"codec-{sname}-{option}")
            fresh_dir(os.path.dirname(d))
            settle()
            t0 = time.perf_counter()
            snapshard.save(d, state, options=SaveOptions(compression=option), overwrite=True)
            save_s = time.perf_counter() - t0
            size, _ = du_bytes(d)
            evict(d)
            t0 = time.perf_counter()
            snapshard.load(d)
            load_s = time.perf_counter() - t0
            raw = sum(x.nbytes for x in jax.tree.leaves(state))
            emit(what="compression", state=sname, codec=str(option), stored_bytes=size,
                 save_gbs=raw / save_s / 1e9, restore_gbs=raw / load_s / 1e9)  # fmt: skip
            if option is None:
                base_size, base_save, base_load = size, save_s, load_s
            else:
                assert base_size is not None
                rows.append((f"{sname} {option}: bytes / plain", size / base_size, ""))
                rows.append((f"{sname} {option}: save time / plain", save_s / base_save, ""))
                rows.append((f"{sname} {option}: restore time / plain", load_s / base_load, ""))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=0.1, help="1.0: the 2 GiB peer-bench state")
    p.add_argument("--rank", type=int, default=0, help="adapter rank (0: ~5%% of the bytes)")
    p.add_argument("--skip-compression", action="store_true")
    args = p.parse_args()
    if args.rank == 0:  # 6 f32 (rows x r or r x cols) per weight ~ 5% of its rows x cols
        rows, cols = tree_spec(args.scale)["layers.00.w"][0]
        args.rank = max(1, round(0.053 * rows * cols / (6 * (rows + cols)) * 27 / 24))
    from common import mesh

    m = mesh(2, 4)
    table = bench_incremental(args, m)
    if not args.skip_compression and compression.available():
        table += bench_compression(args)
    print(f"\nscale {args.scale}, adapter rank {args.rank}")
    for name, v, target in table:
        print(f"  {name:48s} {v:8.3f}  {target}")


if __name__ == "__main__":
    main()
