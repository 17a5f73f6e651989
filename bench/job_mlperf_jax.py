"""One process of one JAX job of bench_mlperf_shape.py: Orbax's or snapshard's saves, then
restores, of the llama3-8b-shaped ZeRO-3 state of bench/job_mlperf.py, as global jax.Arrays;
process 0 prints one `RESULT {json}` line in the form job_mlperf.py prints it.

Started by the driver as WORLD_SIZE processes with the torch job's environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT); they meet through `jax.distributed.initialize` at
MASTER_ADDR:MASTER_PORT, CPU backend, one CPU device per process, gloo collectives. The
state is job_mlperf.py's (its shape functions, imported): for every parameter of llama3-8b
at `--scale`, its bf16 value and AdamW's fp32 master, exp_avg and exp_avg_sq, each a 1-D
jax.Array of the flattened size with NamedSharding(P("x")) on a 1-D mesh of every
process's device (in process order), so each process holds 1/world of every tensor and
nothing is replicated. The tree is `{"model": {fqn: bf16}, "optim": {fqn: {"master",
"exp_avg", "exp_avg_sq"}}}`. JAX cuts a dimension only evenly: every tensor's size is a
multiple of 8 (dim is 32 x head dim), so 1, 2, 4 and 8 processes work at any scale.
Values are seeded by (tensor, role, process) and rekeyed before every save as in the torch
job (the low mantissa bits XORed with a key of the save), on a host copy that the arrays
are then rebuilt from, untimed; the host copy is also what restores are checked against.

The job, every process: warm-up (the norm tensors saved and restored once, unrecorded),
then `--saves` saves, each into a new directory after process 0 removed the previous one
and ran os.sync, untimed; then `--restores` restores of the last save after process 0
fsync'd and dropped every file of it from the page cache (posix_fadvise DONTNEED). Each
operation: a barrier, then each process times its own call. A restore's target is
abstract (jax.ShapeDtypeStruct with the save's sharding): the library allocates the new
arrays inside the call, as JAX restores do (the torch job fills a preallocated target); the
call is timed up to `block_until_ready`. Every restored local shard is compared byte for
byte with the host copy, on every process.

Methods:
  orbax          orbax.checkpoint.StandardCheckpointer: save(path, state) then
                 wait_until_finished(); restore(path, abstract target). TensorStore fsyncs
                 the array data files, the OCDBT manifests and their directories, but Orbax
                 writes _METADATA, _CHECKPOINT_METADATA, array_metadatas/ and
                 commit_success.txt without fsync and renames its temporary directory to
                 the checkpoint's name without an fsync of the parent: after
                 wait_until_finished() (which returns on every process only once process 0
                 has committed) process 0 fsyncs every file and directory of the checkpoint
                 and its parent, inside its time
  snapshard-jax  snapshard.save(path, state) (durable by itself) / snapshard.load(path,
                 abstract target)

usage (the driver runs it): RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. \\
    python bench/job_mlperf_jax.py --method orbax --scale 0.001 --saves 10 --restores 10 --dir D
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc
from job_mlperf import (
    ROLES,
    WARMUP,
    RawBeside,
    evict,
    job_args,
    local_range,
    own_info,
    params,
    print_result,
    shape_for,
)

METHODS = ("orbax", "snapshard-jax")


# ---------------------------------------------------------------- the processes
class Group:
    """Barriers and all-gathers over jax.distributed's key-value service (no device
    computation, so no collective sits inside a measured time)."""

    def __init__(self, timeout_s: float) -> None:
        import jax
        from jax._src import distributed

        self.client = distributed.global_state.client
        self.rank, self.world = jax.process_index(), jax.process_count()
        self.timeout_ms = int(timeout_s * 1000)
        self.n = 0  # every process counts its calls alike: the names match

    def barrier(self) -> None:
        self.n += 1
        self.client.wait_at_barrier(f"mlperf/barrier/{self.n}", self.timeout_ms)

    def gather(self, x: Any) -> list[Any]:
        """Every process's `x` (JSON-able), in process order, on every process."""
        self.n += 1
        prefix = f"mlperf/gather/{self.n}/"
        self.client.key_value_set(prefix + str(self.rank), json.dumps(x))
        self.barrier()
        got = dict(self.client.key_value_dir_get(prefix))
        return [json.loads(got[prefix + str(r)]) for r in range(self.world)]


def init_jax(timeout_s: float) -> Group:
    """Join the job from the driver's torch-style environment: one CPU device here."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    bc.join_jax_job(
        f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), timeout_s=int(timeout_s),
    )  # fmt: skip
    if len(jax.local_devices()) != 1:
        raise SystemExit(f"one CPU device per process expected, not {jax.local_devices()}")
    return Group(timeout_s)


# ---------------------------------------------------------------- the state
def sharding() -> Any:
    """P("x") over a 1-D mesh of every process's device, in process order (Shard(0) on
    the torch job's mesh)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return NamedSharding(Mesh(np.array(devices), ("x",)), PartitionSpec("x"))


def local_slice(numel: int, shard: Any, rank: int, world: int) -> tuple[int, int]:
    """This process's [start, stop) of a tensor, as JAX cuts it; the same as the torch
    job's (checked), so both jobs hold the same bytes per process."""
    if numel % world:
        raise SystemExit(f"JAX cuts only evenly: {numel} elements over {world} processes")
    (index,) = shard.addressable_devices_indices_map((numel,)).values()
    got = (index[0].start or 0, numel if index[0].stop is None else index[0].stop)
    if got != local_range(numel, world, rank):
        raise SystemExit(f"JAX's cut {got} differs from the torch job's")
    return got


def build_host(cfg: dict[str, int], shard: Any, rank: int, world: int) -> dict[str, dict[str, Any]]:
    """fqn -> role -> this process's seeded slice as a NumPy array (bf16 params, fp32 rest)."""
    import numpy as np
    from ml_dtypes import bfloat16

    out: dict[str, dict[str, Any]] = {}
    for fqn, shape in params(cfg):
        start, stop = local_slice(math.prod(shape), shard, rank, world)
        roles = {}
        for role in ROLES:
            rng = np.random.default_rng(zlib.crc32(f"{fqn}/{role}/{rank}".encode()))
            x = rng.standard_normal(stop - start, dtype=np.float32)
            if role == "exp_avg_sq":
                x = np.square(x) * np.float32(1e-6)
            else:
                x *= np.float32(0.02 if role in ("param", "master") else 1e-3)
            roles[role] = x.astype(bfloat16) if role == "param" else x
        out[fqn] = roles
    return out


def to_global(host: dict[str, dict[str, Any]], cfg: dict[str, int], shard: Any) -> dict:
    """fqn -> role -> a global jax.Array of the host slices (copied: the host copy is
    rekeyed in place later)."""
    import jax

    (device,) = jax.local_devices()
    sizes = {f: math.prod(s) for f, s in params(cfg)}
    out = {
        f: {
            r: jax.make_array_from_single_device_arrays(
                (sizes[f],), shard, [jax.device_put(x, device, may_alias=False)]
            )
            for r, x in roles.items()
        }
        for f, roles in host.items()
    }
    return jax.block_until_ready(out)  # the copies are done before any clock starts


def abstract(host: dict[str, dict[str, Any]], cfg: dict[str, int], shard: Any) -> dict:
    """The restore target: a ShapeDtypeStruct of the save's sharding per tensor."""
    import jax

    sizes = {f: math.prod(s) for f, s in params(cfg)}
    return {
        f: {r: jax.ShapeDtypeStruct((sizes[f],), x.dtype, sharding=shard) for r, x in roles.items()}
        for f, roles in host.items()
    }


def tree(flat: dict[str, dict[str, Any]], fqns: list[str]) -> dict[str, Any]:
    """The torch job's state dict layout."""
    return {
        "model": {f: flat[f]["param"] for f in fqns},
        "optim": {f: {r: flat[f][r] for r in ROLES[1:]} for f in fqns},
    }


def rekey(host: dict[str, dict[str, Any]], old: int, new: int) -> None:
    """XOR every element's low bits with old ^ new (keys < 128: bf16's mantissa), in place."""
    import numpy as np

    k = old ^ new
    for roles in host.values():
        for x in roles.values():
            x.view(np.int16 if x.itemsize == 2 else np.int32)[...] ^= k


def leaf(t: dict[str, Any], fqn: str, role: str) -> Any:
    """A role's tensor in the tree layout of `tree`."""
    return t["model"][fqn] if role == "param" else t["optim"][fqn][role]


def same(restored: dict[str, Any], host: dict[str, dict[str, Any]], fqns: list[str]) -> bool:
    """Every local shard of the restored tree equals the host copy byte for byte."""
    import numpy as np

    for f in fqns:
        for r in ROLES:
            (piece,) = leaf(restored, f, r).addressable_shards
            if not np.array_equal(np.asarray(piece.data).view(np.uint8), host[f][r].view(np.uint8)):
                return False
    return True


# ---------------------------------------------------------------- the methods
def fsync_tree(path: str) -> None:
    """fsync every file and directory under path, and its parent (for the rename that
    made it)."""
    for d, _, names in os.walk(path):
        for name in names:
            bc.fsync_path(os.path.join(d, name))
        bc.fsync_path(d)
    bc.fsync_path(os.path.dirname(path))


def methods(method: str, rank: int) -> tuple[Callable[[Any, str], None], Callable[[Any, str], Any]]:
    """(save(state, path), load(abstract target, path) -> restored tree, ready)."""
    import jax

    if method == "orbax":
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()

        def save(state: Any, path: str) -> None:
            ckptr.save(path, state)
            ckptr.wait_until_finished()
            if rank == 0:  # what Orbax leaves unsynced (see the docstring)
                fsync_tree(path)

        def load(target: Any, path: str) -> Any:
            return jax.block_until_ready(ckptr.restore(path, target))

        return save, load

    import snapshard

    def snap_save(state: Any, path: str) -> None:
        snapshard.save(path, state)

    def snap_load(target: Any, path: str) -> Any:
        return jax.block_until_ready(snapshard.load(path, target))

    return snap_save, snap_load


# ---------------------------------------------------------------- the job
def main() -> None:
    args = job_args(__doc__, METHODS)

    warnings.filterwarnings("ignore")
    g = init_jax(args.timeout)
    import jax

    rank, world = g.rank, g.world

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        g.barrier()
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out

    cfg = shape_for(args.scale)
    fqns = [f for f, _ in params(cfg)]
    shard = sharding()
    host = build_host(cfg, shard, rank, world)
    rank_bytes = sum(x.nbytes for roles in host.values() for x in roles.values())
    target = tree(abstract(host, cfg, shard), fqns)
    save, load = methods(args.method, rank)
    if rank == 0:
        os.makedirs(args.dir, exist_ok=True)

    # Warm-up: the norms through the method once, unrecorded.
    warm = os.path.join(args.dir, "warmup")
    g.barrier()
    state = to_global(host, cfg, shard)
    save(tree(state, list(WARMUP)), warm)
    restored = load(tree(abstract(host, cfg, shard), list(WARMUP)), warm)
    warm_ok = same(restored, host, list(WARMUP))
    del restored
    g.barrier()
    if rank == 0:
        shutil.rmtree(warm, ignore_errors=True)

    raw = None
    if args.raw_beside:  # this process's bytes, and buffers of its own to read them into
        import numpy as np

        own = [host[f][r].reshape(-1).view(np.uint8) for f in fqns for r in ROLES]
        scratch = [np.ones(b.nbytes, np.uint8) for b in own]
        raw = RawBeside(args.dir, own, scratch, rank, lambda fn: g.gather(timed(fn)[0]))
    saves: list[list[float]] = []
    key, path, previous = 0, "", ""
    for i in range(args.saves):
        new_key = i % 127 + 1
        rekey(host, key, new_key)
        del state  # the arrays of the previous key, then those of this one
        state = to_global(host, cfg, shard)
        sd = tree(state, fqns)
        key, previous, path = new_key, path, os.path.join(args.dir, f"save-{i}")
        if rank == 0:
            if previous:
                shutil.rmtree(previous, ignore_errors=True)
            os.sync()

        def method_save(p: str = path, s: Any = sd) -> list[float]:
            return g.gather(timed(lambda: save(s, p))[0])

        saves.append(raw.save(i, method_save) if raw else method_save())
    del state, sd

    restores: list[list[float]] = []
    exact: list[bool] = []
    on_disk = 0
    for i in range(args.restores):
        gc.collect()  # the previous restore's arrays are gone before the next one
        if rank == 0:
            on_disk = evict(path)
        got: list[Any] = []

        def method_restore(got: list[Any] = got) -> list[float]:
            dt, restored = timed(lambda: load(target, path))
            got.append(restored)
            return g.gather(dt)

        restores.append(raw.restore(i, method_restore) if raw else method_restore())
        exact.append(all(g.gather(same(got.pop(), host, fqns))))
    g.barrier()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    info = g.gather(own_info(rank_bytes, warm_ok))
    if rank == 0:
        print_result(args.method, world, cfg, info, on_disk, saves, restores, exact, raw)
    g.barrier()
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
