"""One rank of one job of bench_mlperf_shape.py: one method's saves, then its restores, of a
llama3-8b-shaped ZeRO-3 training state; rank 0 prints one `RESULT {json}` line.

Started by the driver as WORLD_SIZE processes that meet through torch.distributed's env://
rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; gloo, CPU). The state: for every
parameter of llama3-8b (at `--scale`, see `shape_for`), its bf16 value and AdamW's fp32
master copy, exp_avg and exp_avg_sq, each flattened to 1-D and cut over every rank as a
DTensor with Shard(0) on a 1-D mesh (ZeRO-3 / FSDP1's flat parameters: no replica). The
state dict is `{"model": {fqn: bf16}, "optim": {fqn: {"master", "exp_avg", "exp_avg_sq"}}}`.
Values are seeded by (tensor, role, rank); before save i the low bits of every element are
XORed with a key of that save (its mantissa only: values stay finite), so every save writes
bytes no earlier save wrote.

The job, every rank:
1. builds the state and its restore target, saves and restores the norm tensors once
   through the method, unrecorded (imports, thread pools, first plans);
2. `--saves` times: rank 0 removes the previous save's checkpoint and flushes the
   machine's dirty pages (os.sync), then a barrier, then each rank times its own call of the
   method's save into a new directory; the times and bytes are gathered (untimed);
3. `--restores` times: a new, zero-filled target (pages touched before the clock), rank 0
   fsyncs and drops every file of the last checkpoint from the page cache
   (posix_fadvise(POSIX_FADV_DONTNEED)), a barrier, then each rank times its own call of
   the method's load of the last checkpoint; every local shard of the target is then
   compared byte for byte with the state that was saved.
With `--raw-beside`, each save and restore of 2. and 3. has the raw one of the same bytes
beside it (`RawBeside`), reported as raw_save_s and raw_restore_s.

Methods:
  raw            each rank writes the bytes of its local shards into one file (os.write,
                 os.fsync, then its directory fsync'd) and reads them back into the
                 target's tensors (os.readv straight into their memory): the floor
  snapshard      snapshard.torch.save(path, state) / snapshard.torch.load(path, target)
  dcp            dcp.save / dcp.load with FileSystemWriter (sync_files=True) /
                 FileSystemReader; rank 0 fsyncs the checkpoint's directories after its
                 save returns (DCP does not), inside its time
  dcp+snapshard  dcp.save / dcp.load with snapshard.torch.StorageWriter / StorageReader

usage (the driver runs it): RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. \\
    python bench/job_mlperf.py --method raw --scale 0.001 --saves 10 --restores 10 --dir D
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import shutil
import sys
import time
import warnings
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc

METHODS = ("raw", "snapshard", "dcp", "dcp+snapshard")
ROLES = ("param", "master", "exp_avg", "exp_avg_sq")  # param: bf16, the others fp32
BYTES_PER_PARAM = 2 + 4 + 4 + 4
# llama3-8b: 32 layers, head dim 128, 32 heads, 8 kv heads; dim 4096 = 32 x 128, kv dim
# 1024 = 8 x 128, ffn hidden 14336 = 112 x 128, vocab 128256 = 1002 x 128.
LAYERS, HEAD_DIM, N_HEADS, N_KV_HEADS, FFN_PER_HEAD_DIM, VOCAB_PER_HEAD_DIM = (
    32,
    128,
    32,
    8,
    112,
    1002,
)
WARMUP = ("norm.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight")


# ---------------------------------------------------------------- the shape (no torch here)
def dims(layers: int, head_dim: int) -> dict[str, int]:
    return {
        "layers": layers,
        "head_dim": head_dim,
        "dim": N_HEADS * head_dim,
        "kv_dim": N_KV_HEADS * head_dim,
        "ffn": FFN_PER_HEAD_DIM * head_dim,
        "vocab": VOCAB_PER_HEAD_DIM * head_dim,
    }


def params(cfg: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """(fqn, shape) of every parameter, in torchtitan's llama3 naming."""
    d, kv, ffn, vocab = cfg["dim"], cfg["kv_dim"], cfg["ffn"], cfg["vocab"]
    out: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (vocab, d))]
    for i in range(cfg["layers"]):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (d, d)),
            (p + "attention.wk.weight", (kv, d)),
            (p + "attention.wv.weight", (kv, d)),
            (p + "attention.wo.weight", (d, d)),
            (p + "feed_forward.w1.weight", (ffn, d)),
            (p + "feed_forward.w2.weight", (d, ffn)),
            (p + "feed_forward.w3.weight", (ffn, d)),
            (p + "attention_norm.weight", (d,)),
            (p + "ffn_norm.weight", (d,)),
        ]
    return [*out, ("norm.weight", (d,)), ("output.weight", (vocab, d))]


def state_bytes(cfg: dict[str, int]) -> int:
    return BYTES_PER_PARAM * sum(math.prod(s) for _, s in params(cfg))


FULL_BYTES = state_bytes(dims(LAYERS, HEAD_DIM))  # 112,423,657,472 B (8,030,261,248 params)


def shape_for(scale: float) -> dict[str, int]:
    """llama3-8b's shape at about `scale` times its bytes: the number of layers first (the
    nearest count, at least 1), then, below one full-width layer, every width at once (the
    head dim, which sets dim, kv dim, ffn hidden and vocab in llama3-8b's proportions:
    the nearest byte count over head dims 1-128, one layer)."""
    if not 0 < scale <= 1:
        raise SystemExit(f"--scale must be in (0, 1], not {scale}")
    target = scale * FULL_BYTES
    one = state_bytes(dims(1, HEAD_DIM))
    if target >= one:
        fixed = state_bytes(dims(0, HEAD_DIM))  # embeddings, output, final norm
        layers = round((target - fixed) / (one - fixed))
        return dims(min(LAYERS, max(1, layers)), HEAD_DIM)
    head_dim = min(range(1, HEAD_DIM + 1), key=lambda h: abs(state_bytes(dims(1, h)) - target))
    return dims(1, head_dim)


def local_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """This rank's [start, stop) of a 1-D tensor cut by Shard(0) (torch.chunk's cut)."""
    size = -(-numel // world)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


# ---------------------------------------------------------------- the state
def build(cfg: dict[str, int], mesh: Any, fill: bool) -> dict[str, dict[str, Any]]:
    """fqn -> role -> DTensor (1-D, Shard(0)): seeded values, or zeros (a restore target)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    out: dict[str, dict[str, Any]] = {}
    for fqn, shape in params(cfg):
        numel = math.prod(shape)
        start, stop = local_range(numel, world, rank)
        n = stop - start
        roles: dict[str, torch.Tensor] = {}
        for role in ROLES:
            dtype = torch.bfloat16 if role == "param" else torch.float32
            if not fill:
                roles[role] = torch.zeros(n, dtype=dtype)
                continue
            g = torch.Generator().manual_seed(zlib.crc32(f"{fqn}/{role}/{rank}".encode()))
            x = torch.randn(n, generator=g)
            if role == "exp_avg_sq":
                x.square_().mul_(1e-6)
            else:
                x.mul_(0.02 if role in ("param", "master") else 1e-3)
            roles[role] = x.to(dtype)
        out[fqn] = {
            role: DTensor.from_local(
                t, mesh, [Shard(0)], run_check=False, shape=torch.Size([numel]), stride=(1,)
            )
            for role, t in roles.items()
        }
    return out


def state_dict(flat: dict[str, dict[str, Any]], fqns: list[str]) -> dict[str, Any]:
    return {
        "model": {f: flat[f]["param"] for f in fqns},
        "optim": {f: {r: flat[f][r] for r in ROLES[1:]} for f in fqns},
    }


def local_tensors(flat: dict[str, dict[str, Any]], fqns: list[str]) -> list[Any]:
    """The local shards, in a fixed order (the raw method's file layout)."""
    return [flat[f][r].to_local() for f in fqns for r in ROLES]


def rekey(tensors: list[Any], old: int, new: int) -> None:
    """XOR every element's low bits with old ^ new: the state goes from save key `old` to
    `new` (keys < 128: inside bf16's 7 mantissa bits, so values stay finite)."""
    import torch

    k = old ^ new
    for t in tensors:
        t.view(torch.int16 if t.element_size() == 2 else torch.int32).bitwise_xor_(k)


def as_bytes(t: Any) -> Any:
    """A uint8 NumPy view of a contiguous 1-D tensor's memory."""
    import torch

    return t.view(torch.uint8).numpy()


# ---------------------------------------------------------------- the methods
def raw_write(buffers: list[Any], path: str, rank: int) -> None:
    """The raw save: this rank's bytes (uint8 arrays) back to back into one durable file."""
    bc.write_durable(path, f"rank{rank}.bin", buffers)


def raw_read(buffers: list[Any], path: str, rank: int) -> None:
    """The raw restore: this rank's file read back with os.readv straight into `buffers`."""
    fd = os.open(os.path.join(path, f"rank{rank}.bin"), os.O_RDONLY)
    try:
        for b in buffers:
            mv = memoryview(b)
            while len(mv):
                n = os.readv(fd, [mv])
                if n == 0:
                    raise OSError(f"{path}: rank {rank}'s file is short")
                mv = mv[n:]
    finally:
        os.close(fd)


def raw_save(tensors: list[Any], path: str, rank: int) -> None:
    raw_write([as_bytes(t) for t in tensors], path, rank)


def raw_load(tensors: list[Any], path: str, rank: int) -> None:
    raw_read([as_bytes(t) for t in tensors], path, rank)


class RawBeside:
    """`--raw-beside`: the raw write (read) of this rank's bytes right beside each of the
    method's saves (restores), in the same processes, alternating which goes first, so that
    the ratio to raw is paired per operation rather than across jobs run minutes apart on
    a disk whose speed drifts. The raw restore reads into buffers of its own (`scratch`),
    never into the method's target."""

    def __init__(
        self,
        directory: str,
        own: list[Any],
        scratch: list[Any],
        rank: int,
        timed: Callable[[Callable[[], Any]], list[float]],
    ) -> None:
        self.directory, self.own, self.scratch = directory, own, scratch
        self.rank, self.timed = rank, timed  # timed(fn): every process's seconds for fn
        self.saves: list[list[float]] = []
        self.restores: list[list[float]] = []
        self.path = ""

    def save(self, i: int, method_save: Callable[[], list[float]]) -> list[float]:
        """The method's save i and the raw one beside it; the method's times."""
        previous, self.path = self.path, os.path.join(self.directory, f"raw-{i}")
        if self.rank == 0 and previous:
            shutil.rmtree(previous, ignore_errors=True)

        def raw() -> None:
            self.saves.append(self.timed(lambda: raw_write(self.own, self.path, self.rank)))

        return self._beside(i, raw, method_save)

    def restore(self, i: int, method_restore: Callable[[], list[float]]) -> list[float]:
        """The method's restore i and the raw one beside it (its file evicted first too)."""

        def raw() -> None:
            if self.rank == 0:
                evict(self.path)
            self.restores.append(self.timed(lambda: raw_read(self.scratch, self.path, self.rank)))

        return self._beside(i, raw, method_restore)

    @staticmethod
    def _beside(i: int, raw: Callable[[], None], method: Callable[[], list[float]]) -> list[float]:
        if i % 2:
            took = method()
            raw()
            return took
        raw()
        return method()


def fsync_dirs(path: str) -> None:
    """FileSystemWriter fsyncs its files, not its directories: done here."""
    for d, _, _ in os.walk(path):
        bc.fsync_path(d)
    bc.fsync_path(os.path.dirname(path))


def evict(path: str) -> int:
    """fsync, then drop from the page cache, every file under path; returns their bytes."""
    total = 0
    for d, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def methods(
    method: str, rank: int
) -> tuple[Callable[[dict, list, str], None], Callable[[dict, list, str], None]]:
    """(save(state dict, local tensors, path), load(target dict, local tensors, path))."""
    import torch.distributed.checkpoint as dcp

    import snapshard.torch as sst

    def dcp_save(sd: dict, _: list, path: str) -> None:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))  # sync_files=True
        if rank == 0:  # after DCP's last collective every rank's files are in
            fsync_dirs(path)

    table = {
        "raw": (
            lambda _, ts, path: raw_save(ts, path, rank),
            lambda _, ts, path: raw_load(ts, path, rank),
        ),
        "snapshard": (
            lambda sd, _, path: sst.save(path, sd),
            lambda sd, _, path: sst.load(path, sd),
        ),
        "dcp": (
            dcp_save,
            lambda sd, _, path: dcp.load(sd, storage_reader=dcp.FileSystemReader(path)),
        ),
        "dcp+snapshard": (
            lambda sd, _, path: dcp.save(sd, storage_writer=sst.StorageWriter(path)),
            lambda sd, _, path: dcp.load(sd, storage_reader=sst.StorageReader(path)),
        ),
    }
    return table[method]


# ---------------------------------------------------------------- the job
def own_info(rank_bytes: int, warm_ok: bool) -> dict[str, Any]:
    """What each process tells rank 0 of itself at the end of a job."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"bytes": rank_bytes, "peak_rss": peak, "warm_ok": bool(warm_ok)}


def print_result(
    method: str,
    world: int,
    cfg: dict[str, int],
    info: list[dict[str, Any]],
    on_disk: int,
    saves: list[list[float]],
    restores: list[list[float]],
    exact: list[bool],
    raw: RawBeside | None = None,
) -> None:
    """Rank 0's RESULT line, which bench_mlperf_shape.py reads (every job's, torch or JAX)."""
    import json

    result = {
        "method": method, "world": world, "cfg": cfg, "total_B": state_bytes(cfg),
        "rank_B": [x["bytes"] for x in info], "peak_rss_B": [x["peak_rss"] for x in info],
        "on_disk_B": on_disk, "save_s": saves, "restore_s": restores, "restore_exact": exact,
        "warmup_exact": all(x["warm_ok"] for x in info),
    }  # fmt: skip
    if raw is not None:
        result |= {"raw_save_s": raw.saves, "raw_restore_s": raw.restores}
    print("RESULT " + json.dumps(result), flush=True)


def job_args(doc: str | None, methods: tuple[str, ...]) -> argparse.Namespace:
    """The options every MLPerf job takes (the torch job's and the JAX job's)."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--method", choices=methods, required=True)
    ap.add_argument("--scale", type=float, required=True)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--restores", type=int, default=10)
    ap.add_argument("--dir", required=True, help="this job's folder of checkpoints")
    ap.add_argument("--timeout", type=float, default=3600, help="of every collective, s")
    ap.add_argument(
        "--raw-beside", action="store_true", help="a raw save (restore) beside each: RawBeside"
    )
    return ap.parse_args()


def main() -> None:
    args = job_args(__doc__, METHODS)

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def gather(x: Any) -> list[Any]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, x)
        return out

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def same(a: list[Any], b: list[Any]) -> bool:
        return all(
            torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
        )

    cfg = shape_for(args.scale)
    fqns = [f for f, _ in params(cfg)]
    state = build(cfg, mesh, fill=True)
    tensors = local_tensors(state, fqns)
    rank_bytes = sum(t.numel() * t.element_size() for t in tensors)
    save, load = methods(args.method, rank)
    if rank == 0:
        os.makedirs(args.dir, exist_ok=True)

    # Warm-up: the norms through the method once, unrecorded.
    warm = os.path.join(args.dir, "warmup")
    dist.barrier()
    save(state_dict(state, list(WARMUP)), local_tensors(state, list(WARMUP)), warm)
    target = build(cfg, mesh, fill=False)
    load(state_dict(target, list(WARMUP)), local_tensors(target, list(WARMUP)), warm)
    warm_ok = same(local_tensors(target, list(WARMUP)), local_tensors(state, list(WARMUP)))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(warm, ignore_errors=True)

    sd = state_dict(state, fqns)
    raw = None
    if args.raw_beside and args.method != "raw":
        scratch = [as_bytes(t) for t in local_tensors(build(cfg, mesh, fill=False), fqns)]
        own = [as_bytes(t) for t in tensors]
        raw = RawBeside(args.dir, own, scratch, rank, lambda fn: gather(timed(fn)))
    saves: list[list[float]] = []
    key, path, previous = 0, "", ""
    for i in range(args.saves):
        new_key = i % 127 + 1
        rekey(tensors, key, new_key)
        key, previous, path = new_key, path, os.path.join(args.dir, f"save-{i}")
        if rank == 0:
            if previous:
                shutil.rmtree(previous, ignore_errors=True)
            os.sync()

        def method_save(p: str = path) -> list[float]:
            return gather(timed(lambda: save(sd, tensors, p)))

        saves.append(raw.save(i, method_save) if raw else method_save())

    restores: list[list[float]] = []
    exact: list[bool] = []
    on_disk = 0
    for i in range(args.restores):
        del target
        gc.collect()
        target = build(cfg, mesh, fill=False)
        target_sd, target_tensors = state_dict(target, fqns), local_tensors(target, fqns)
        if rank == 0:
            on_disk = evict(path)

        def method_restore(s: Any = target_sd, t: list[Any] = target_tensors) -> list[float]:
            return gather(timed(lambda: load(s, t, path)))

        restores.append(raw.restore(i, method_restore) if raw else method_restore())
        per_rank = gather(same(target_tensors, tensors))
        exact.append(all(per_rank))
    del target
    dist.barrier()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    info = gather(own_info(rank_bytes, warm_ok))
    if rank == 0:
        print_result(args.method, world, cfg, info, on_disk, saves, restores, exact, raw)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
