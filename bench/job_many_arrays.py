"""One job of bench_many_arrays.py: one library's saves and restores of many small arrays,
in this fresh process (or in each process of a jax.distributed job), printing one RESULT line.

Libraries: snap_jax and orbax (jax.Arrays), floor (the device transfers and one file, the
floors of the JAX side), snap_torch and dcp (CPU tensors, one process only). Every
operation is timed `--repeats` + 1 times (the first is a restart's: reported apart); with
several processes each starts at a barrier, and the driver takes the slowest process.
Each operation's memory is the peak RSS during it over the RSS before it: the kernel's
high-water mark reset on entry through /proc/self/clear_refs, or, where that is refused,
the RSS sampled every 2 ms by a thread (the RESULT says which: `memory_method`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc

MIX_MIB = (16, 32, 48, 64)  # --mix: a few large arrays beside the many small ones
MIX_COLS = 1024


# ---------------------------------------------------------------- memory
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else 0


class PeakMemory:
    """The peak RSS of the block over the RSS on entry (`extra`), in bytes."""

    def __enter__(self) -> PeakMemory:
        self.before = _status_bytes("VmRSS")
        self.method = "hwm" if bc.reset_peak_rss() else "sampled"
        self._peak = self.before
        self._stop = threading.Event()
        if self.method == "sampled":
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, _status_bytes("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        if self.method == "hwm":
            self._peak = _status_bytes("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
        self.extra = max(0, self._peak - self.before)


# ---------------------------------------------------------------- the state
def host_state(n: int, side: int, mesh: bool, mix: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """The host arrays and how each is laid out on the mesh ('cut': sharded on the first
    axis over every device; 'whole': replicated). Without a mesh: n arrays of side x side
    float32; on one: side x 16, every other one cut. --mix adds MIX_MIB arrays, cut."""
    import numpy as np

    shape = (side, 16) if mesh else (side, side)
    block = np.random.default_rng(0).standard_normal((n, *shape), np.float32)
    host = {f"layers.{i:06d}.w": block[i] for i in range(n)}
    kinds = {k: "cut" if i % 2 == 0 else "whole" for i, k in enumerate(host)}
    if mix:
        rng = np.random.default_rng(1)
        for j, mib in enumerate(MIX_MIB):
            rows = (mib << 20) // (4 * MIX_COLS)
            host[f"big.{j}"] = rng.standard_normal((rows, MIX_COLS), np.float32)
            kinds[f"big.{j}"] = "cut"
    return host, kinds


def device_state(
    host: dict[str, Any], kinds: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state as jax.Arrays on a mesh of every device of the job, and their shardings."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("d",))
    by_kind = {
        "cut": NamedSharding(mesh, PartitionSpec("d")),
        "whole": NamedSharding(mesh, PartitionSpec()),
    }
    shardings = {k: by_kind[kinds[k]] for k in host}
    if jax.process_count() == 1:
        arrays = jax.device_put(list(host.values()), list(shardings.values()))
    else:  # every process builds the shards its devices hold
        arrays = [
            jax.make_array_from_callback(v.shape, shardings[k], v.__getitem__)
            for k, v in host.items()
        ]
    return dict(zip(host, jax.block_until_ready(arrays), strict=True)), shardings


def matches(out: dict[str, Any], host: dict[str, Any]) -> bool:
    """Every restored shard this process holds equals the host array's slice, bit for bit."""
    import numpy as np

    return all(
        np.array_equal(np.asarray(s.data), host[k][s.index])
        for k in host
        for s in out[k].addressable_shards
    )


def barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ---------------------------------------------------------------- timing
Op = Callable[[], Any]


# The ops that read the state's arrays: each is given arrays no one has read yet, as a
# training step's are (see `measure`).
READS_STATE = ("save", "async_block", "device_get", "shard_views")


def measure(
    ops: dict[str, Op],
    repeats: int,
    check: Callable[[], bool] | None = None,
    refresh: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Each op `repeats` + 1 times, in order: lists of seconds (an op that returns a float
    times itself: save_async's blocking part) and of memory over the RSS before it
    (`<op>_s`, `<op>_mem_B`), and whether every check after a round held. `refresh`, called
    untimed before every op that reads the state (READS_STATE), puts new arrays of the same
    values in it: JAX keeps the host copy of a sharded array that was once fetched, so a
    second `device_get` of the same arrays costs a tenth of the first, which a save in a
    training loop never meets."""
    res: dict[str, Any] = {f"{k}_{x}": [] for k in ops for x in ("s", "mem_B")}
    ok = True
    method = ""
    for r in range(repeats + 1):
        for name, op in ops.items():
            if refresh is not None and name in READS_STATE:
                refresh()
            barrier(f"{name}-{r}")
            with PeakMemory() as mem:
                t = time.perf_counter()
                got = op()
                took = time.perf_counter() - t
            res[f"{name}_s"].append(got if isinstance(got, float) else took)
            res[f"{name}_mem_B"].append(mem.extra)
            method = mem.method
        ok = ok and (check() if check is not None else True)
    return {**res, "exact": ok, "memory_method": method}


# ---------------------------------------------------------------- the jobs
def floor_ops(
    state: dict[str, Any], host: dict[str, Any], shardings: dict[str, Any], root: str
) -> tuple[dict[str, Op], Callable[[], bool]]:
    """The floors, per process: a batched device_get of what this process must write (its
    arrays; with several processes, the shards of replica 0 it holds) and one fsync'd
    write of those bytes (`save`), device_get alone; one read of a file holding the
    slices this process's devices need and one make_array_from_callback per array
    (`load`), and a batched device_put of the host arrays onto their shardings."""
    import jax
    import numpy as np

    one = jax.process_count() == 1

    def owned() -> list[Any]:  # the state is refreshed between operations: asked each time
        if one:
            return list(state.values())
        return [s.data for a in state.values() for s in a.addressable_shards if s.replica_id == 0]

    path = os.path.join(root, f"state.{jax.process_index()}.bin")
    need = _needed_slices(host, shardings)
    need_path = os.path.join(root, f"need.{jax.process_index()}.bin")
    # Each piece at a 64-byte aligned offset, as snapshard's buffers are: XLA's CPU client
    # aliases aligned host buffers and copies the others, which would slow the floor.
    offsets, need_bytes = [], 0
    with open(need_path, "wb") as f:
        for piece in need.values():
            pad = -need_bytes % 64
            f.write(b"\0" * pad)
            offsets.append(need_bytes + pad)
            f.write(memoryview(np.ascontiguousarray(piece)).cast("B"))
            need_bytes += pad + piece.nbytes
    out: list[Any] = []

    def save() -> None:
        arrays = jax.device_get(owned())
        with open(path, "wb") as f:
            f.write(b"".join(memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays))
            f.flush()
            os.fsync(f.fileno())

    def load() -> None:
        raw = np.empty(need_bytes + 64, np.uint8)
        buf = raw[-raw.ctypes.data % 64 :][:need_bytes]
        with open(need_path, "rb") as f:
            f.readinto(memoryview(buf))
        pieces = {}
        for (key, p), at in zip(need.items(), offsets, strict=True):
            pieces[key] = buf[at : at + p.nbytes].view(p.dtype).reshape(p.shape)
        out[:] = [
            jax.make_array_from_callback(
                v.shape, shardings[k], lambda idx, k=k: pieces[(k, _key(idx))]
            )
            for k, v in host.items()
        ]
        jax.block_until_ready(out)

    def put() -> None:
        if one:
            jax.block_until_ready(jax.device_put(list(host.values()), list(shardings.values())))

    def views() -> None:  # one process: a host view of one copy of every distinct shard
        for a in state.values():
            if a.is_fully_replicated:
                np.asarray(a)
            else:  # sharded over every device: each shard is distinct
                for s in a.addressable_shards:
                    np.asarray(s.data)

    ops = {"save": save, "load": load, "device_get": lambda: jax.device_get(owned())}
    if one and jax.devices()[0].platform == "cpu":
        ops["shard_views"] = views
    if (
        one
    ):  # a device_put of host arrays onto devices of other processes is not one process's floor
        ops["device_put"] = put
    return ops, lambda: matches(dict(zip(host, out, strict=True)), host)


def _key(idx: tuple[slice, ...]) -> tuple[tuple[int | None, int | None], ...]:
    return tuple((s.start, s.stop) for s in idx)


def _needed_slices(host: dict[str, Any], shardings: dict[str, Any]) -> dict[tuple[str, Any], Any]:
    """The distinct slices of each array this process's devices hold."""
    need = {}
    for k, v in host.items():
        for idx in shardings[k].addressable_devices_indices_map(v.shape).values():
            need.setdefault((k, _key(idx)), v[idx])
    return need


def jax_ops(
    lib: str, state: dict[str, Any], host: dict[str, Any], root: str, async_block: bool
) -> tuple[dict[str, Op], Callable[[], bool]]:
    """snap_jax or orbax: a durable save and a restore into ShapeDtypeStructs on the
    arrays' shardings (the last restore kept until the new one is in, so that memory
    counts the new state, not the freed pages of the old one);
    snap_jax on a mesh also `save_async`'s blocking time (`async_block`)."""
    import jax

    abstract = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }
    out: dict[str, Any] = {}
    n = {"save": 0, "async": 0}

    def where(what: str) -> str:
        n[what] += 1
        path = os.path.join(root, f"{what}_{n[what]}")
        if n[what] > 1 and jax.process_index() == 0:
            bc.remove(os.path.join(root, f"{what}_{n[what] - 1}"))
        return path

    if lib == "snap_jax":
        import snapshard

        def save() -> None:
            snapshard.save(where("save"), state)

        def load() -> None:
            out.update(snapshard.load(os.path.join(root, f"save_{n['save']}"), abstract))

        def block() -> float:  # the time up to save_async's return; its commit waited for after
            t = time.perf_counter()
            pending = snapshard.save_async(where("async"), state)
            blocked = time.perf_counter() - t
            pending.wait()
            return blocked
    else:
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()

        def save() -> None:  # durable by default: TensorStore fsyncs its files
            ckptr.save(where("save"), state)
            ckptr.wait_until_finished()

        def load() -> None:
            out.update(ckptr.restore(os.path.join(root, f"save_{n['save']}"), abstract))

    ops: dict[str, Op] = {"save": save, "load": load}
    if lib == "snap_jax" and async_block:
        ops["async_block"] = block
    return ops, lambda: matches(out, host)


def torch_ops(
    lib: str, host: dict[str, Any], root: str
) -> tuple[dict[str, Op], Callable[[], bool]]:
    """snap_torch or dcp, one process: a durable save and a restore in place into
    `empty_like` tensors."""
    import numpy as np
    import torch

    state = {k: torch.from_numpy(v) for k, v in host.items()}
    target = {k: torch.empty_like(v) for k, v in state.items()}
    path = os.path.join(root, "step")
    if lib == "snap_torch":
        import snapshard.torch as st

        def save() -> None:
            bc.remove(path)
            st.save(path, state)

        def load() -> None:
            st.load(path, target)
    else:
        import torch.distributed.checkpoint as dcp

        def save() -> None:  # sync_files=True (DCP's default): durable
            bc.remove(path)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)

        def load() -> None:
            dcp.load(target, checkpoint_id=path, no_dist=True)

    return {"save": save, "load": load}, lambda: all(
        np.array_equal(target[k].numpy(), host[k]) for k in host
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--arrays", type=int, required=True)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mesh", type=int, default=0, help="CPU devices per process (0: torch too)")
    ap.add_argument("--mix", action="store_true")
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    if args.processes > 1:
        bc.join_jax_job(f"127.0.0.1:{args.port}", args.processes, args.process_id, timeout_s=120)
    host, kinds = host_state(args.arrays, args.side, bool(args.mesh), args.mix)
    root = bc.ckpt_dir(f"many-{args.lib}")
    if args.process_id == 0:
        bc.fresh_dir(root)
        os.makedirs(root, exist_ok=True)
    resident = sum(v.nbytes for v in host.values())
    refresh: Callable[[], None] | None = None
    if args.lib in ("snap_torch", "dcp"):
        ops, check = torch_ops(args.lib, host, root)
    else:
        state, shardings = device_state(host, kinds)

        def renew() -> None:  # new arrays of the same values, as after a training step
            state.clear()
            state.update(device_state(host, kinds)[0])

        refresh = renew

        # What the state occupies here: a replicated array once per device of this process.
        resident = sum(s.data.nbytes for a in state.values() for s in a.addressable_shards)
        barrier("made")
        if args.lib == "floor":
            ops, check = floor_ops(state, host, shardings, root)
        else:
            ops, check = jax_ops(args.lib, state, host, root, bool(args.mesh))
    res = measure(ops, args.repeats, check, refresh)
    barrier("done")
    if args.process_id == 0:
        bc.remove(root)
    if args.mesh:
        import jax

        res |= {"devices": len(jax.devices()), "device_kind": jax.devices()[0].device_kind}
    bc.emit(lib=args.lib, arrays=args.arrays, side=args.side, mesh=args.mesh, mix=args.mix,
            processes=args.processes, process=args.process_id,
            state_B=sum(v.nbytes for v in host.values()), resident_B=resident, **res)  # fmt: skip
    if args.processes > 1:
        import jax

        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
