"""Benchmark: load a multi-file safetensors checkpoint onto a (2, 4) mesh.

Compares snapshard.safetensors.load with safetensors.numpy.load_file + jax.device_put, and
with Orbax's safetensors layout (orbax-checkpoint v1 API) when the installed version has it.
Rounds are interleaved (every method once per round) and medians reported. The checkpoint is
written once with the safetensors library (float32, several files and an index) and reused;
files are read from the page cache after the first round, so this measures the loaders, not
the disk.

  python bench/bench_safetensors.py              # ~1 GiB
  python bench/bench_safetensors.py --small      # ~64 MiB, for a quick check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import snapshard
import snapshard.safetensors as sst

COLS = 2048
FILES = 4
TENSORS_PER_FILE = 8


def write_checkpoint(directory: Path, total_bytes: int) -> None:
    """FILES files of TENSORS_PER_FILE float32 tensors and an index, unless already there."""
    marker = directory / "bench.json"
    if marker.exists() and json.loads(marker.read_text()) == {"bytes": total_bytes}:
        return
    directory.mkdir(parents=True, exist_ok=True)
    rows = max(8, total_bytes // (FILES * TENSORS_PER_FILE * COLS * 4) // 8 * 8)
    rng = np.random.default_rng(0)
    weight_map = {}
    for f in range(FILES):
        name = f"model-{f + 1:05d}-of-{FILES:05d}.safetensors"
        tensors = {
            f"layers.{f * TENSORS_PER_FILE + i}.weight": rng.standard_normal(
                (rows, COLS), dtype=np.float32
            )
            for i in range(TENSORS_PER_FILE)
        }
        save_file(tensors, str(directory / name))
        weight_map.update(dict.fromkeys(tensors, name))
    index = {
        "metadata": {"total_size": rows * COLS * 4 * len(weight_map)},
        "weight_map": weight_map,
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    marker.write_text(json.dumps({"bytes": total_bytes}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="~64 MiB instead of ~1 GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spec", choices=["rows", "cols", "2d"], default="rows")
    ap.add_argument(
        "--dir", default=os.path.join(tempfile.gettempdir(), "snapshard-bench-safetensors")
    )
    args = ap.parse_args()
    total = (64 if args.small else 1024) << 20
    directory = Path(args.dir) / f"{total >> 20}MiB"
    write_checkpoint(directory, total)

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    spec = {
        "rows": P(("data", "model"), None),
        "cols": P(None, ("data", "model")),
        "2d": P("data", "model"),
    }[args.spec]
    sharding = NamedSharding(mesh, spec)
    lazy = sst.arrays(directory)
    target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for k, x in lazy.items()}
    files = sorted(directory.glob("*.safetensors"))
    file_bytes = sum(f.stat().st_size for f in files)
    data_bytes = sum(x.nbytes for x in lazy.values())

    read_bytes: dict[str, int | None] = {}

    def snapshard_load() -> object:
        stats = snapshard.ReadStats()
        out = sst.load(directory, target, stats=stats)
        read_bytes["snapshard"] = stats.bytes_read
        return out

    def numpy_then_device_put() -> object:
        out = {}
        for f in files:
            for k, v in load_file(f).items():
                out[k] = jax.device_put(v, sharding)
        read_bytes["load_file + device_put"] = file_bytes
        return out

    methods: dict[str, Callable[[], object]] = {
        "snapshard": snapshard_load,
        "load_file + device_put": numpy_then_device_put,
    }
    try:
        from orbax.checkpoint import v1 as ocp

        def orbax_load() -> object:
            ctx = ocp.Context()
            ctx.checkpoint_layout = "safetensors"
            with ctx:
                out = ocp.load(directory, target)
            read_bytes["orbax (safetensors layout)"] = None
            return out

        methods["orbax (safetensors layout)"] = orbax_load
    except (ImportError, AttributeError) as e:
        print(f"orbax safetensors loading not available: {e}")

    times: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.rounds + 1):  # the first round warms the page cache and JAX
        for name, fn in methods.items():
            gc.collect()
            t0 = time.perf_counter()
            out = fn()
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t0)
            del out
    base = statistics.median(times["snapshard"][1:])
    print(
        f"\n{len(lazy)} tensors, {data_bytes / 2**30:.2f} GiB in {len(files)} files, mesh (2, 4), "
        f"spec {spec}, 1 process x 8 CPU devices, {args.rounds} interleaved rounds (+1 warm-up)\n"
    )
    print("| method | median s | GiB/s | time / snapshard | bytes read (this process) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        rb = read_bytes.get(name)
        print(
            f"| {name} | {med:.3f} | {data_bytes / 2**30 / med:.2f} | {med / base:.2f} | "
            f"{'not reported' if rb is None else f'{rb:,}'} |"
        )


if __name__ == "__main__":
    main()
