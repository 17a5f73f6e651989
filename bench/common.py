"""Shared helpers of the save/restore benchmarks: the bench pytree, meters, cache eviction.

The methods follow the project's peer benchmark: every save is fsync'd (files and
directories), jobs run in fresh processes, and "evicted" reads drop the files from the page
cache with posix_fadvise(DONTNEED) first. Job scripts print one `RESULT {json}` line per
measured operation; the drivers collect them.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

# ---------------------------------------------------------------- where things go


def bench_dir() -> str:
    """Scratch root for checkpoints: $SNAPSHARD_BENCH_DIR, else a folder in the temp dir."""
    return os.environ.get("SNAPSHARD_BENCH_DIR") or os.path.join(
        tempfile.gettempdir(), "snapshard-bench"
    )


def new_s3_bucket(prefix: str = "snapshard-bench") -> str:
    """A new, empty bucket on the local S3 server that AWS_ENDPOINT_URL names (the tests'
    own helper, tests/s3env.py); returns its name."""
    import sys

    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from s3env import create_bucket

    return str(create_bucket(prefix))


def ckpt_dir(name: str) -> str:
    return os.path.join(bench_dir(), "ckpt", name)


# ---------------------------------------------------------------- the bench pytree
# At scale 1 (2,139,586,560 B, the peer benchmark's state):
#   24 x f32  (4096, 5120) weights   sharded P(None, 'model') on mesh (data=2, model=4)
#    3 x bf16 (4096, 5120) embeddings, same sharding
#   24 x f32  (5120,) biases, fully replicated
# --scale shrinks the rows of the big arrays (kept a multiple of 8 so every mesh divides).
N_W, N_E = 24, 3
ROWS, COLS = 4096, 5120


def rows_for(scale: float) -> int:
    return max(8, round(ROWS * scale / 8) * 8)


def tree_spec(scale: float = 1.0) -> dict[str, tuple[tuple[int, ...], str, str]]:
    """Flat name -> (shape, dtype name, kind); kind 'w' is sharded, 'b' fully replicated."""
    rows = rows_for(scale)
    spec = {}
    for i in range(N_W):
        spec[f"layers.{i:02d}.w"] = ((rows, COLS), "float32", "w")
        spec[f"layers.{i:02d}.b"] = ((COLS,), "float32", "b")
    for i in range(N_E):
        spec[f"embed.{i}"] = ((rows, COLS), "bfloat16", "w")
    return spec


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def payload_bytes(scale: float = 1.0) -> int:
    return sum(int(np.prod(s)) * np_dtype(d).itemsize for s, d, _ in tree_spec(scale).values())


def make_array(name: str, scale: float = 1.0) -> np.ndarray:
    """Deterministic N(0, 0.02) values seeded by the name: the peer benchmark's exact bytes at
    scale 1, so Orbax's compression sees the same data as there."""
    shape, dt, _ = tree_spec(scale)[name]
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(name))
    a = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    a *= np.float32(0.02)
    return a if dt == "float32" else a.astype(np_dtype(dt))


def nest(flat: dict) -> dict:
    """'layers.00.w' -> {'layers': {'00': {'w': ...}}}."""
    out: dict = {}
    for k, v in flat.items():
        d = out
        *parents, last = k.split(".")
        for p in parents:
            d = d.setdefault(p, {})
        d[last] = v
    return out


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


# Leaves checked bit for bit after every restore (one f32 weight, one bf16, one bias).
CHECK_LEAVES = ("layers.03.w", "embed.1", "layers.05.b")
WARMUP_LEAVES = ("layers.00.w", "layers.00.b", "embed.0")


# ---------------------------------------------------------------- JAX set-up
def join_jax_job(address: str, processes: int, process_id: int, timeout_s: int = 300) -> None:
    """Join a jax.distributed job on the CPU backend, its collectives over gloo
    (`timeout_s`: how long to wait for the others, JAX's default 300 s)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        address, num_processes=processes, process_id=process_id, initialization_timeout=timeout_s
    )


def force_cpu_devices(n: int) -> None:
    """Ask XLA for n CPU devices; must run before jax is imported."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def mesh(data: int, model: int):
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()).reshape(data, model), ("data", "model"))


def sharding_for(kind: str, m, reshard: bool):
    """The save layout P(None, 'model'), or the reshard layout P('model', None); biases P()."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if kind == "b":
        return NamedSharding(m, P())
    return NamedSharding(m, P("model", None) if reshard else P(None, "model"))


def build_tree(names, scale: float, m) -> dict:
    """The bench pytree as jax.Arrays in the save layout, one host array alive at a time."""
    import jax

    spec = tree_spec(scale)
    flat = {}
    for k in names:
        full = make_array(k, scale)
        sh = sharding_for(spec[k][2], m, False)
        flat[k] = jax.make_array_from_callback(full.shape, sh, lambda idx, f=full: f[idx])
        del full
    jax.block_until_ready(flat)
    return nest(flat)


def abstract(tree: dict, scale: float, m, reshard: bool) -> dict:
    """ShapeDtypeStructs with shardings: the restore target."""
    import jax

    spec = tree_spec(scale)
    return nest(
        {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding_for(spec[k][2], m, reshard))
            for k, v in flatten(tree).items()
        }
    )


def delete_tree(tree) -> None:
    import jax

    for x in jax.tree.leaves(tree):
        x.delete()


def check_restored(flat: dict, scale: float) -> bool:
    """Every addressable shard of the check leaves equals the generated values, bit for bit."""
    ok = True
    for k in CHECK_LEAVES:
        if k not in flat:
            continue
        ref = make_array(k, scale)
        for s in flat[k].addressable_shards:
            ok &= np.asarray(s.data).tobytes() == ref[s.index].tobytes()
    return bool(ok)


# ---------------------------------------------------------------- measuring
def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return r.ru_utime + r.ru_stime


def proc_io() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def sys_cpu() -> tuple[float, float, float]:
    """System-wide CPU seconds from /proc/stat: (busy, iowait, steal)."""
    try:
        with open("/proc/stat") as f:
            p = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0, 0.0
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, iowait, irq, softirq, steal = p[:8]
    return (user + nice + system + irq + softirq) / hz, iowait / hz, steal / hz


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+)", f.read(), re.M)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) of this process to its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Meter:
    """Wall clock, process CPU, others' CPU, /proc/self/io and peak RSS of one operation.

    Peak RSS is the kernel's high-water mark, reset on entry, so it covers every thread of
    the operation, including background writers, with no sampling.
    """

    def __enter__(self) -> Meter:
        self.io0 = proc_io()
        self.rss0 = _status_kib("VmRSS") * 1024
        self.hwm_ok = reset_peak_rss()
        self.s0 = sys_cpu()
        self.c0 = cpu_s()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> bool:
        self.wall = time.perf_counter() - self.t0
        self.cpu = cpu_s() - self.c0
        s1 = sys_cpu()
        self.sys_busy, self.iowait, self.steal = (b - a for a, b in zip(self.s0, s1, strict=True))
        self.peak_rss = _status_kib("VmHWM") * 1024 if self.hwm_ok else 0
        io1 = proc_io()
        self.read_bytes = io1.get("read_bytes", 0) - self.io0.get("read_bytes", 0)
        self.write_bytes = io1.get("write_bytes", 0) - self.io0.get("write_bytes", 0)
        return False

    def as_dict(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}_s": round(self.wall, 4),
            f"{prefix}_cpu_s": round(self.cpu, 3),
            # CPU burnt by the whole machine in the window: minus ours = everyone else's
            # (kernel writeback working for us included).
            f"{prefix}_sys_busy_s": round(self.sys_busy, 2),
            f"{prefix}_iowait_s": round(self.iowait, 2),
            f"{prefix}_steal_s": round(self.steal, 2),
            f"{prefix}_proc_read_B": self.read_bytes,
            f"{prefix}_proc_write_B": self.write_bytes,
            f"{prefix}_rss_before_B": self.rss0,
            f"{prefix}_peak_rss_B": self.peak_rss,
        }


def emit(**kw: object) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


# ---------------------------------------------------------------- files
def fsync_path(path: str) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str, name: str, buffers: Iterable[Any]) -> None:
    """The buffers written back to back with os.write into file `name` of directory `path`
    (made if missing), then the file and the directory fsync'd: the plain durable write."""
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for b in buffers:
            mv = memoryview(b).cast("B")
            while len(mv):
                mv = mv[os.write(fd, mv) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path)


def fresh_dir(path: str) -> None:
    """Remove path (a checkpoint of an earlier run) and make sure its parent exists."""
    if os.path.exists(path):
        shutil.rmtree(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def du_bytes(path: str) -> tuple[int, int]:
    """Apparent bytes and file count of a tree."""
    size = files = 0
    for root, _, names in os.walk(path):
        for n in names:
            size += os.lstat(os.path.join(root, n)).st_size
            files += 1
    return size, files


def evict(path: str) -> int:
    """Drop the clean cached pages of every file under path (posix_fadvise DONTNEED).

    Needs no privileges; call it after the data is fsync'd. A hypervisor below may still
    cache the blocks, so "evicted" reads are a lower bound of a cold read.
    """
    paths = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    )
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(paths)


def settle() -> None:
    """Flush dirty pages of a previous step so they are not billed to the next one."""
    os.sync()


# ---------------------------------------------------------------- drivers
def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a jax.distributed coordinator."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_results(procs: list[Any], timeout: float = 600) -> list[Any]:
    """Each worker process's first `RESULT {json}` line on its stdout, in order; exits
    with the stderr of the first that failed or printed none."""
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        lines = [json.loads(x[7:]) for x in stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not lines:
            raise SystemExit(f"worker failed:\n{stderr[-3000:]}")
        out.append(lines[0])
    return out


def children_cpu() -> float:
    """CPU seconds of the finished child processes (the jobs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def spread(v: list[float], nd: int = 2) -> str:
    """median [min-max] of a list, for the tables."""
    import statistics

    if not v:
        return "n/a"
    if len(v) == 1:
        return f"{v[0]:.{nd}f}"
    med = statistics.median(v)
    return f"{med:.{nd}f} [{min(v):.{nd}f}-{max(v):.{nd}f}]"


def ratio_table(title: str, checks: list[tuple[str, list[float], str]], nd: int = 2) -> None:
    """Print (name, values, target such as '>= 3') rows with their median [min-max] and
    whether the median meets the target."""
    import statistics

    print(f"\n## {title}\n")
    print("| ratio | value | target | met |")
    print("|---|---|---|---|")
    for name, v, target in checks:
        met = ""
        if v and target:
            op, x = target.split()
            m = statistics.median(v)
            met = "yes" if (m >= float(x) if op == ">=" else m <= float(x)) else "NO"
        print(f"| {name} | {spread(v, nd)} | {target} | {met} |")


def library_at(rev: str, into: str) -> str:
    """The library's source tree as of git commit `rev`, extracted under `into` (for
    benchmarks of one version against another); returns the directory to put on PYTHONPATH."""
    import subprocess
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data = subprocess.run(
        ["git", "-C", root, "archive", rev, "src"], check=True, capture_output=True
    ).stdout
    path = os.path.join(into, f"src-{rev}.tar")
    with open(path, "wb") as f:
        f.write(data)
    with tarfile.open(path) as t:
        t.extractall(into, filter="data")
    return os.path.join(into, "src")
