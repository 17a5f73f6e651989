"""Multi-process worker: jax.Arrays on sub-meshes (the devices of some processes only).

usage: jax_submesh.py DIR
   Run as 2 processes of 4 CPU devices each. Saves one tree with `snapshard.save`
   (DIR/sync) and with `snapshard.save_async` (DIR/async), and a tree of process 0's
   arrays only (DIR/p0only); then restores onto the same sub-meshes, onto other ones
   (the other process's devices, every device, a mesh over both processes), with
   read-once forced, and a target naming a leaf that was never saved. Every value is
   compared bit-exactly, shard by shard, with `reference()` (the test loads the same
   checkpoints into NumPy in its own process and compares them with it too).

Devices: P0 = process 0's 4 devices, P1 = process 1's, MIX = the first 2 of each
(mesh ('proc', 'm'): a row per process), ALL = all 8. (`_dist` is imported where it is
used, so that the test can import `reference` and `digest`.)
"""

from __future__ import annotations

import hashlib
import sys
import traceback


def reference() -> dict:
    """The saved values (NumPy; PRNG keys as their key data), the same in every process."""
    import jax
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(20240611)
    return {
        "a": rng.standard_normal((64, 48), dtype=np.float32),
        "a_rep": rng.standard_normal((40, 6), dtype=np.float32),
        "b": rng.integers(-(2**31), 2**31 - 1, size=(24, 16), dtype=np.int32),
        "c": rng.standard_normal((32, 20), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "d": rng.standard_normal((16, 8), dtype=np.float32),
        "e": rng.standard_normal((256, 1024), dtype=np.float32),
        "full": rng.standard_normal((64,), dtype=np.float32),
        "s0": np.float32(rng.standard_normal()),
        "key": np.asarray(jax.random.key_data(jax.random.split(jax.random.key(7), 8))),
        "key1": np.asarray(jax.random.key_data(jax.random.split(jax.random.key(8), 4))),
        "host": np.arange(10, dtype=np.int32) * 3,  # (int64 would be int32 on jax targets)
    }


KEYS = ("key", "key1")


def digest(a) -> str:
    import numpy as np

    a = np.ascontiguousarray(np.asarray(a))
    return hashlib.sha256(str((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()


def main() -> None:
    from _dist import init, report

    base = sys.argv[1]
    pid, _n = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    from snapshard import ReadOptions, SaveOptions

    ref = reference()
    devs = sorted(jax.devices(), key=lambda d: d.id)
    mine = {q: [d for d in devs if d.process_index == q] for q in (0, 1)}
    assert all(len(v) == 4 for v in mine.values()), devs
    meshes = {
        "P0": Mesh(np.array(mine[0]).reshape(2, 2), ("x", "y")),
        "P1": Mesh(np.array(mine[1]).reshape(2, 2), ("x", "y")),
        "P0flat": Mesh(np.array(mine[0]), ("x",)),
        "P1flat": Mesh(np.array(mine[1]), ("x",)),
        "MIX": Mesh(np.array([mine[0][:2], mine[1][:2]]), ("proc", "m")),
        "ALL": Mesh(np.array(devs), ("x",)),
    }

    def sh(mesh: str, *spec) -> NamedSharding:
        return NamedSharding(meshes[mesh], P(*spec))

    def key_array(data: np.ndarray, sharding) -> jax.Array:
        """Typed keys from key data: each addressable device wraps its own box (no process
        runs a computation on devices it does not have)."""
        shape = data.shape[:-1]
        shards = [
            jax.random.wrap_key_data(jax.device_put(np.ascontiguousarray(data[idx]), d))
            for d, idx in sharding.addressable_devices_indices_map(shape).items()
        ]
        dtype = jax.random.key(0).dtype  # (a process without shards must say it)
        return jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=dtype)

    def put(name: str, sharding) -> jax.Array:
        x = ref[name]
        if name in KEYS:
            return key_array(x, sharding)
        return jax.make_array_from_callback(
            np.shape(x), sharding, lambda idx: x[idx], dtype=np.asarray(x).dtype
        )

    def sds(name: str, sharding):
        if name in KEYS:
            k = jax.random.split(jax.random.key(0), ref[name].shape[0])
            return jax.ShapeDtypeStruct(k.shape, k.dtype, sharding=sharding)
        return jax.ShapeDtypeStruct(np.shape(ref[name]), ref[name].dtype, sharding=sharding)

    saved_on = {
        "a": sh("P0", "x", "y"),
        "a_rep": sh("P0flat"),  # replicated on process 0's devices
        "b": sh("P1flat", None, "x"),
        "c": sh("MIX", "m"),  # each box on both processes
        "d": sh("MIX", ("proc", "m")),  # each box on one device
        "e": sh("MIX", None, "m"),  # 1 MiB, each box on both processes
        "full": sh("ALL", "x"),
        "s0": sh("P1flat"),  # a 0-d array on process 1 only
        "key": sh("P0flat", "x"),
        "key1": sh("P1flat"),
    }
    tree = {name: put(name, s) for name, s in saved_on.items()}
    for name, x in tree.items():  # the inputs are what the test means them to be
        assert len(x.addressable_shards) == len(saved_on[name].addressable_devices), name
    tree["host"] = ref["host"]
    tree["pp"] = snapshard.PerProcess({"pid": pid, "tag": f"proc{pid}"})
    tree["step"] = 17

    results: dict = {"pid": pid}
    opts = SaveOptions(timeout_s=60)
    t = snapshard.save(f"{base}/sync", tree, options=opts)
    results["sync_bytes_written"] = t.bytes_written
    pending = snapshard.save_async(f"{base}/async", tree, options=opts)
    results["async_bytes_written"] = pending.wait(120).bytes_written
    only0 = {"a": tree["a"], "a_rep": tree["a_rep"], "key": tree["key"], "step": 1}
    results["p0only_bytes_written"] = snapshard.save(
        f"{base}/p0only", only0, options=opts
    ).bytes_written

    def check(out: dict, target: dict) -> dict:
        """Per leaf: [all compared bytes equal, local shards compared, the target's devices]."""
        got = {}
        for name, t in target.items():
            x = out[name]
            if name in ("pp", "step"):
                continue
            s = getattr(t, "sharding", None)
            if s is None:  # a NumPy target
                got[name] = [digest(x) == digest(ref[name]), 1, 0]
                continue
            ok = isinstance(x, jax.Array) and x.shape == t.shape and x.dtype == t.dtype
            ok &= x.sharding.device_set == s.device_set
            ok &= len(x.addressable_shards) == len(s.addressable_devices)
            for shard in x.addressable_shards:
                data = jax.random.key_data(shard.data) if name in KEYS else shard.data
                ok &= digest(data) == digest(ref[name][shard.index])
            got[name] = [bool(ok), len(x.addressable_shards), len(s.device_set)]
        return got

    def load(where: str, target: dict, **kw) -> dict:
        stats = snapshard.ReadStats()
        out = snapshard.load(f"{base}/{where}", target, stats=stats, **kw)
        got = check(out, target)
        if "pp" in target:
            got["pp"] = out["pp"] == {"pid": pid, "tag": f"proc{pid}"}
        if "step" in target:
            got["step"] = out["step"]
        return {"leaves": got, "stats": stats.as_dict()}

    # 1. Onto the sharding each leaf was saved on (sync and async saves).
    same = {name: sds(name, s) for name, s in saved_on.items()}
    same |= {"host": np.zeros(10, np.int32), "pp": snapshard.PerProcess(None), "step": 0}
    results["same_sync"] = load("sync", same)
    results["same_async"] = load("async", same)

    # 2. Onto other sub-meshes: the other process's devices, every device, both processes.
    other_on = {
        "a": sh("P1", "y", "x"),
        "a_rep": sh("MIX", "proc"),
        "b": sh("P0flat", "x", None),
        "c": sh("ALL", "x"),
        "d": sh("P0"),
        "e": sh("P1flat", "x"),
        "full": sh("P1", "x"),
        "s0": sh("P0"),
        "key": sh("P1flat"),
        "key1": sh("MIX", "m"),
        "host": sh("P0flat"),
    }
    other = {name: sds(name, s) for name, s in other_on.items()}
    # A jax.Array as the target of one leaf (its sharding is what counts).
    other["b"] = jax.make_array_from_callback(
        ref["b"].shape, other_on["b"], lambda idx: np.zeros_like(ref["b"][idx]), dtype=np.int32
    )
    results["other_sync"] = load("sync", other)
    results["other_async"] = load("async", other)

    # 3. Read-once forced: replicated targets on MIX and on ALL (different device sets in
    # one batch) beside sub-mesh targets of one process.
    once_on = {
        "e": sh("MIX"),
        "c": sh("ALL"),
        "b": sh("MIX"),
        "full": sh("MIX", ("proc", "m")),
        "a": sh("P0"),
        "a_rep": sh("P1"),
        "d": sh("ALL"),
    }
    once = {name: sds(name, s) for name, s in once_on.items()}
    results["read_once"] = load("sync", once, options=ReadOptions(read_once=True))

    # ... and so inside `jax.set_mesh` of every device (the reshard of targets on other
    # meshes must not be bound to it).
    set_mesh = getattr(jax, "set_mesh", None)
    if set_mesh is not None:
        with set_mesh(meshes["ALL"]):
            in_mesh = {"e": sds("e", sh("MIX", "m")), "b": sds("b", sh("ALL"))}
            once_opts = ReadOptions(read_once=True)
            results["read_once_in_mesh"] = load("async", in_mesh, options=once_opts)

    # 4. A target of one process's devices only: the other process reads nothing.
    results["only_a"] = load("sync", {"a": sds("a", sh("P0", "x", "y"))})
    results["only_b_on_p1"] = load("async", {"b": sds("b", sh("P1", "y", "x"))})
    results["p0only_on_p1"] = load(
        "p0only",
        {"a": sds("a", sh("P1", None, "y")), "a_rep": sds("a_rep", sh("P1")),
         "key": sds("key", sh("P1flat", "x")), "step": 0},
    )  # fmt: skip
    results["p0only_on_mix"] = load(
        "p0only", {"a": sds("a", sh("MIX", "m", "proc")), "a_rep": sds("a_rep", sh("MIX"))}
    )

    # 5. A target leaf that no process saved.
    try:
        snapshard.load(
            f"{base}/p0only", {"a": sds("a", sh("P0")), "absent": sds("b", sh("P1flat"))}
        )
        results["missing"] = None
    except Exception as e:
        results["missing"] = f"{type(e).__name__}: {e}"

    report(**results)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip jax.distributed's shutdown barrier: the other process may be stuck.
        import os

        os._exit(3)
