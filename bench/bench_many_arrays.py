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

With `--mesh 8`, the JAX side on 8 CPU devices, the layout of a sharded training state:
arrays of `--side` x 16 float32, every other one sharded over the 8 devices on its first
axis, the others replicated. snapshard and Orbax run beside the floors measured in the same
run, in a process of their own: for a save, one batched `jax.device_get` of every array
plus one fsync'd write of the same bytes (`save_floor`); for a restore, one read of that
file and one `make_array_from_callback` per array (`load_floor`), and one batched
`jax.device_put` of the host arrays onto their shardings (`device_put`). snapshard's
`save_async` is timed up to its return (`async_block`), against the batched `device_get`.

    python bench/bench_many_arrays.py --mesh 8 --arrays 1000 --rounds 3
    python bench/bench_many_arrays.py --mesh 8 --arrays 10000 --rounds 3 --repeats 2

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
MESH_LIBRARIES = ("snap_jax", "orbax", "floor")


def _arrays(n: int, side: int) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return {f"layers.{i:04d}.w": rng.standard_normal((side, side), np.float32) for i in range(n)}


def _mesh_arrays(n: int, side: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The host arrays of `--mesh` (side x 16 float32) and the sharding of each: sharded over
    every device on the first axis (even indices) or replicated (odd)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("d",))
    cut, whole = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())
    rng = np.random.default_rng(0)
    host = {f"layers.{i:05d}.w": rng.standard_normal((side, 16), np.float32) for i in range(n)}
    shardings = {k: cut if i % 2 == 0 else whole for i, k in enumerate(host)}
    return host, shardings


def _floor_job(n: int, side: int, repeats: int) -> None:
    """The floors of `--mesh`, in this (fresh) process: the device transfers and one file."""
    import jax
    import numpy as np

    host, shardings = _mesh_arrays(n, side)
    state = {k: jax.device_put(v, shardings[k]) for k, v in host.items()}
    path = os.path.join(bc.ckpt_dir("many-floor"), "state.bin")
    bc.fresh_dir(os.path.dirname(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    nbytes = sum(v.nbytes for v in host.values())

    def save() -> None:  # batched device-to-host copy, one durable write of the bytes
        arrays = jax.device_get(list(state.values()))
        with open(path, "wb") as f:
            f.write(b"".join(memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays))
            f.flush()
            os.fsync(f.fileno())

    def load() -> list[Any]:  # one read of the file, then one transfer per array
        buf = np.empty(nbytes, np.uint8)
        with open(path, "rb") as f:
            f.readinto(memoryview(buf))
        out, at = [], 0
        for k, v in host.items():
            a = buf[at : at + v.nbytes].view(v.dtype).reshape(v.shape)
            at += v.nbytes
            out.append(jax.make_array_from_callback(v.shape, shardings[k], a.__getitem__))
        return jax.block_until_ready(out)

    def put() -> list[Any]:
        return jax.block_until_ready(jax.device_put(list(host.values()), list(shardings.values())))

    def get() -> None:
        jax.device_get(list(state.values()))

    times: dict[str, list[float]] = {"save": [], "load": [], "device_put": [], "device_get": []}
    ok = True
    for _ in range(repeats + 1):
        for name, fn in (("save", save), ("load", load), ("device_put", put), ("device_get", get)):
            t = time.perf_counter()
            out: Any = fn()
            times[name].append(time.perf_counter() - t)
            if name == "load":
                ok = ok and all(np.array_equal(np.asarray(a), h) for a, h in zip(out, host.values(), strict=True))
    bc.remove(os.path.dirname(path))
    bc.emit(
        lib="floor", arrays=n, side=side, mesh=len(jax.devices()), first_save_s=times["save"][0],
        first_load_s=times["load"][0], save_s=statistics.median(times["save"][1:]),
        load_s=statistics.median(times["load"][1:]),
        device_put_s=statistics.median(times["device_put"][1:]),
        device_get_s=statistics.median(times["device_get"][1:]), exact=ok,
    )  # fmt: skip


def _job(lib: str, n: int, side: int, repeats: int, mesh: int) -> None:
    """One library in this (fresh) process: `repeats` + 1 saves and restores."""
    import numpy as np

    if lib == "floor":
        _floor_job(n, side, repeats)
        return
    shardings: dict[str, Any] = {}
    if mesh:
        host, shardings = _mesh_arrays(n, side)
    else:
        host = _arrays(n, side)
    root = bc.ckpt_dir(f"many-{lib}")
    bc.fresh_dir(root)
    os.makedirs(root, exist_ok=True)
    extra: dict[str, Any] = {}
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

        state = {k: jax.device_put(v, shardings.get(k)) for k, v in host.items()}
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

    saves, loads, blocks = [], [], []
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
        if lib == "snap_jax" and mesh:
            blocks.append(_async_block(state, os.path.join(root, f"async_{r}")))
    if blocks:
        extra["async_block_s"] = statistics.median(blocks[1:])
    bc.remove(root)
    bc.emit(
        lib=lib, arrays=n, side=side, mesh=mesh, first_save_s=saves[0], first_load_s=loads[0],
        save_s=statistics.median(saves[1:]), load_s=statistics.median(loads[1:]), exact=ok,
        **extra,
    )  # fmt: skip


def _async_block(state: dict[str, Any], path: str) -> float:
    """How long `save_async` blocks the caller (until every owned slice is on the host)."""
    import snapshard

    t = time.perf_counter()
    pending = snapshard.save_async(path, state)
    blocked = time.perf_counter() - t
    pending.wait()
    bc.remove(path)
    return blocked


def _run(lib: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--job", lib, "--arrays", str(args.arrays),
           "--side", str(args.side), "--repeats", str(args.repeats), "--mesh", str(args.mesh)]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore"}
    if args.mesh:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.mesh}"
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


def _report_mesh(rows: list[dict[str, Any]]) -> None:
    by = {lib: [r for r in rows if r["lib"] == lib] for lib in MESH_LIBRARIES}
    keys = ("first_save_s", "first_load_s", "save_s", "load_s")
    n, side, mesh = rows[0]["arrays"], rows[0]["side"], rows[0]["mesh"]
    print(f"\n## {n} arrays of {side}x16 float32 on {mesh} CPU devices (half sharded, half "
          "replicated), medians over rounds\n")  # fmt: skip
    print("| library | first save | first restore | save | restore | bit-exact |")
    print("|---|---|---|---|---|---|")
    for lib, rs in by.items():
        cells = [bc.spread([r[k] for r in rs], 3) for k in keys]
        print(f"| {lib} | " + " | ".join(cells) + f" | {all(r['exact'] for r in rs)} |")
    floor, ours, orbax = by["floor"], by["snap_jax"], by["orbax"]
    print(f"\nbatched device_put {bc.spread([r['device_put_s'] for r in floor], 3)} s, "
          f"batched device_get {bc.spread([r['device_get_s'] for r in floor], 3)} s, "
          f"snapshard save_async blocking {bc.spread([r['async_block_s'] for r in ours], 3)} s")  # fmt: skip

    def paired(a: list[dict[str, Any]], ka: str, b: list[dict[str, Any]], kb: str) -> list[float]:
        return [x[ka] / y[kb] for x, y in zip(a, b, strict=True)]

    checks = [
        ("snapshard save / floor", paired(ours, "save_s", floor, "save_s"), "<= 2"),
        ("snapshard restore / floor", paired(ours, "load_s", floor, "load_s"), "<= 2"),
        ("snapshard restore / batched device_put", paired(ours, "load_s", floor, "device_put_s"), ""),
        ("save_async blocking / batched device_get",
         paired(ours, "async_block_s", floor, "device_get_s"), "<= 1.5"),
        ("orbax / snapshard, save", paired(orbax, "save_s", ours, "save_s"), ">= 5"),
        ("orbax / snapshard, restore", paired(orbax, "load_s", ours, "load_s"), ">= 5"),
    ]  # fmt: skip
    bc.ratio_table("Ratios, paired by round", checks)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arrays", type=int, default=1000)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mesh", type=int, default=0,
                    help="CPU devices for the JAX side's sharded layout (0: one device, torch too)")
    ap.add_argument("--only", default=None, help="libraries to run, comma-separated")
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument("--job", choices=(*LIBRARIES, "floor"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        _job(args.job, args.arrays, args.side, args.repeats, args.mesh)
        return
    every = MESH_LIBRARIES if args.mesh else LIBRARIES
    libs = [x for x in (args.only or ",".join(every)).split(",") if x]
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
    if set(libs) == set(every):
        (_report_mesh if args.mesh else _report)(rows)


if __name__ == "__main__":
    main()
