"""Compression, side by side in one run: snapshard, Orbax and PyTorch DCP, with and without
zstd, on local disk and on the local S3 server.

Two states, each at `--scale` (1.0: about 2 GiB):

- `peer-bench`: the peer benchmark's state (24 f32 and 3 bf16 (4096, 5120) weights, 24 f32
  biases; N(0, 0.02) values), sharded P(None, 'model') on mesh (data=2, model=4).
- `trained`: a small MLP language model trained `--steps` steps with optax's Adam on a
  synthetic next-token task, saved as bf16 parameters with their f32 Adam moments (mu, nu):
  real values, not random ones. Same sharding.

Variants: snapshard without compression and with `compression="zstd"`; Orbax's
PyTreeCheckpointHandler with its default zstd and with `use_compression=False` (OCDBT on
local disk; on S3 zarr without OCDBT and commit files, as bench_objstore.py configures it);
DCP's FileSystemWriter (2 threads, fsync'd) without and with its ZStandard stream extension.
DCP has no S3 writer here, so it runs on local disk only (the table says so).

Per variant: bytes stored, durable save time (every library synchronous and fsync'd), and
restore time into the save sharding (local: warm from the page cache, and after evicting the
files; S3: one restore). Each round is one fresh process per state that runs every variant
in an order rotated by the round, after a unrecorded warm-up save and restore of each. Tables:
medians [min-max] over rounds, and ratios paired by round before the median.

usage: python bench/bench_compression.py [--scale 0.1] [--rounds 3] [--steps 30] [--no-s3]
       python bench/bench_compression.py --analyze FILE
S3 needs AWS_ENDPOINT_URL and the credentials (as .ci/run exports them); Orbax on S3 also
needs s3fs (the `bench` extra), else its S3 rows are skipped with the reason. With the local
Ceph server, export CEPH_CONF too (bench_objstore.py: deferred deletions are flushed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

from common import (  # noqa: E402
    bench_dir,
    ckpt_dir,
    du_bytes,
    emit,
    evict,
    force_cpu_devices,
    fsync_path,
    new_s3_bucket,
    remove,
    settle,
    spread,
)
from snapshard import SaveOptions  # noqa: E402

STATES = ("peer-bench", "trained")
TRAINED: dict[str, Any] = {}  # how the trained state came about (written beside it)
# (library, codec) in the order of the tables; None: no compression.
VARIANTS = (
    ("snapshard", None),
    ("snapshard", "zstd"),
    ("orbax", None),
    ("orbax", "zstd"),
    ("dcp", None),
    ("dcp", "zstd"),
)


# ---------------------------------------------------------------- the trained state
def train(scale: float, steps: int) -> dict[str, Any]:
    """bf16 parameters and f32 Adam moments of an MLP language model (vocabulary 4096, width
    1024, residual blocks 1024 -> 4096 -> 1024) trained `steps` steps; its size is about
    the peer-bench state's at the same scale (10 bytes per parameter)."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np
    import optax

    from common import payload_bytes

    vocab, d = 4096, 1024
    blocks = max(1, round(payload_bytes(scale) / 10 / (8 * d * d) - 1))
    key = jax.random.key(0)
    ks = jax.random.split(key, 2 * blocks + 3)

    def init(k, shape, fan_in):
        return jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)

    params: dict[str, Any] = {"embed": init(ks[0], (vocab, d), 1.0) * 0.02,
                              "head": init(ks[1], (d, vocab), d)}  # fmt: skip
    for i in range(blocks):
        params[f"blocks.{i:02d}.w1"] = init(ks[2 + 2 * i], (d, 4 * d), d)
        params[f"blocks.{i:02d}.b1"] = jnp.zeros((4 * d,), jnp.float32)
        params[f"blocks.{i:02d}.w2"] = init(ks[3 + 2 * i], (4 * d, d), 4 * d) * 0.5
        params[f"blocks.{i:02d}.b2"] = jnp.zeros((d,), jnp.float32)
    # the task: next token of sequences drawn from a fixed sparse bigram table
    table = jax.random.randint(ks[-1], (vocab, 4), 0, vocab)

    def batch(k):
        k1, k2 = jax.random.split(k)
        x = jax.random.randint(k1, (256,), 0, vocab)
        y = table[x, jax.random.randint(k2, (256,), 0, 4)]
        return x, y

    def loss(p, x, y):
        h = p["embed"][x]
        for i in range(blocks):
            z = jax.nn.gelu(h @ p[f"blocks.{i:02d}.w1"] + p[f"blocks.{i:02d}.b1"])
            h = h + z @ p[f"blocks.{i:02d}.w2"] + p[f"blocks.{i:02d}.b2"]
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y).mean()

    opt = optax.adam(1e-3)
    state = opt.init(params)

    @jax.jit
    def step(p, s, k):
        x, y = batch(k)
        value, g = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, value

    first = last = None
    for i in range(steps):
        params, state, value = step(params, state, jax.random.fold_in(key, i))
        first = float(value) if first is None else first
        last = float(value)
    adam = state[0]
    out = {f"params.{k}": np.asarray(v).astype(ml_dtypes.bfloat16) for k, v in params.items()}
    out.update({f"mu.{k}": np.asarray(v) for k, v in adam.mu.items()})
    out.update({f"nu.{k}": np.asarray(v) for k, v in adam.nu.items()})
    TRAINED.update(what="trained", steps=steps, blocks=blocks, loss_first=first,
                   loss_last=last, bytes=sum(v.nbytes for v in out.values()))  # fmt: skip
    return out


def trained_path(scale: float, steps: int) -> str:
    return os.path.join(bench_dir(), f"trained-{scale}-{steps}.npz")


def save_trained(flat: dict[str, Any], path: str) -> None:
    import numpy as np

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".json", "w") as f:
        json.dump(TRAINED, f)
    raw = {k: (v.view(np.uint16) if v.dtype.itemsize == 2 else v) for k, v in flat.items()}
    np.savez(path, **raw)


def load_trained(path: str) -> dict[str, Any]:
    import ml_dtypes
    import numpy as np

    with np.load(path) as f:
        return {k: (f[k].view(ml_dtypes.bfloat16) if f[k].dtype == np.uint16 else f[k])
                for k in f.files}  # fmt: skip


# ---------------------------------------------------------------- one process per round
def host_state(name: str, scale: float, steps: int) -> dict[str, Any]:
    from common import make_array, tree_spec

    if name == "peer-bench":
        return {k: make_array(k, scale) for k in tree_spec(scale)}
    return load_trained(trained_path(scale, steps))


def on_mesh(flat: dict[str, Any], m: Any) -> dict[str, Any]:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from common import nest

    out = {}
    for k, v in flat.items():
        spec = P(None, "model") if v.ndim == 2 and v.shape[1] % 4 == 0 else P()
        out[k] = jax.make_array_from_callback(
            v.shape, NamedSharding(m, spec), lambda idx, v=v: v[idx]
        )
    jax.block_until_ready(out)
    return nest(out)


class Libraries:
    """Save, restore and measure stored bytes for each library, on a local path or an s3://
    URL."""

    def __init__(self, s3: bool):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.orbax_s3: str | None = None  # why Orbax cannot reach S3, if it cannot
        if s3:
            try:
                import s3fs  # noqa: F401

                from bench_objstore import Orbax

                Orbax()  # points TensorStore's S3 driver at the server (see its docstring)
            except ImportError as e:
                self.orbax_s3 = f"Orbax on S3 needs s3fs ({e})"

    def save(self, lib: str, codec: str | None, where: str, tree: Any, torch_sd: Any) -> None:
        if lib == "snapshard":
            import snapshard

            snapshard.save(where, tree, options=SaveOptions(compression=codec))
        elif lib == "orbax":
            self._orbax(where, codec).save(where, args=self.ocp.args.PyTreeSave(tree))
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._extension import ZStandard

            ext = [ZStandard()] if codec else None
            writer = dcp.FileSystemWriter(where, thread_count=2, sync_files=True, _extensions=ext)
            dcp.save(torch_sd, storage_writer=writer)
            fsync_path(where)  # DCP does not sync the directory

    def restore(self, lib: str, codec: str | None, where: str, target: Any, torch_sd: Any) -> Any:
        import jax

        if lib == "snapshard":
            import snapshard

            return jax.block_until_ready(snapshard.load(where, target))
        if lib == "orbax":
            args = self.ocp.checkpoint_utils.construct_restore_args(target)
            out = self._orbax(where, codec).restore(
                where, args=self.ocp.args.PyTreeRestore(target, restore_args=args)
            )
            return jax.block_until_ready(out)
        import torch
        import torch.distributed.checkpoint as dcp

        dest = {k: torch.empty_like(v) for k, v in torch_sd.items()}
        dcp.load(dest, storage_reader=dcp.FileSystemReader(where))
        return dest

    def _orbax(self, where: str, codec: str | None) -> Any:
        ocp = self.ocp
        if where.startswith("s3://"):
            from orbax.checkpoint._src.path import atomicity

            handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_compression=bool(codec))
            return ocp.Checkpointer(handler, temporary_path_class=atomicity.CommitFileTemporaryPath)
        return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=bool(codec)))

    @staticmethod
    def stored_bytes(where: str) -> int:
        if where.startswith("s3://"):
            from snapshard.storage.object_client import ObjectClient

            return sum(ObjectClient(where).listing().values())
        return du_bytes(where)[0]

    @staticmethod
    def remove(where: str) -> None:
        if where.startswith("s3://"):
            from bench_objstore import remove as remove_s3

            remove_s3(where)
        else:
            remove(where)


def to_torch(flat: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    out = {}
    for k, v in flat.items():
        t = torch.from_numpy(
            np.ascontiguousarray(v).view(np.uint16 if v.dtype.itemsize == 2 else v.dtype)
        )
        out[k] = t.view(torch.bfloat16) if v.dtype.itemsize == 2 else t
    return out


def same_values(lib: str, out: Any, flat: dict[str, Any]) -> bool:
    import numpy as np

    from common import flatten

    if lib == "dcp":
        got = {k: v.view(dtype=__import__("torch").uint16).numpy() if v.itemsize == 2 else v.numpy()
               for k, v in out.items()}  # fmt: skip
        return all(got[k].tobytes() == np.ascontiguousarray(v).tobytes() for k, v in flat.items())
    res = flatten(out)
    return all(
        np.asarray(s.data).tobytes() == flat[k][s.index].tobytes()
        for k in flat
        for s in res[k].addressable_shards
    )


def job(args: argparse.Namespace) -> None:
    force_cpu_devices(8)
    import warnings

    warnings.filterwarnings("ignore")
    import jax

    from common import mesh

    m = mesh(2, 4)
    flat = host_state(args.state, args.scale, args.steps)
    tree = on_mesh(flat, m)
    torch_sd = to_torch(flat)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    libs = Libraries(args.bucket is not None)
    runs = [(lib, codec, "local") for lib, codec in VARIANTS]
    if args.bucket is not None:
        runs += [(lib, codec, "s3") for lib, codec in VARIANTS if lib != "dcp"]
        if args.round == 0:
            emit(what="skipped", storage="s3", lib="dcp",
                 why="torch.distributed.checkpoint has no S3 storage writer here")  # fmt: skip
            if libs.orbax_s3:
                emit(what="skipped", storage="s3", lib="orbax", why=libs.orbax_s3)
        if libs.orbax_s3:
            runs = [r for r in runs if not (r[0] == "orbax" and r[2] == "s3")]
    k = args.round % len(runs)
    order = runs[k:] + runs[:k]
    # warm-up: each library and storage once with a few leaves, unrecorded
    names = list(flat)[:3]
    few = {n: flat[n] for n in names}
    few_tree, few_sd = on_mesh(few, m), to_torch(few)
    few_target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), few_tree
    )
    for lib, codec, storage in order:
        one(libs, lib, codec, storage, args, few_tree, few_target, few_sd, few, record=False)
    for lib, codec, storage in order:
        one(libs, lib, codec, storage, args, tree, target, torch_sd, flat, record=True)


def one(libs: Libraries, lib: str, codec: str | None, storage: str, args: argparse.Namespace,
        tree: Any, target: Any, torch_sd: Any, flat: dict[str, Any], record: bool) -> None:  # fmt: skip
    tag = f"{args.state}-{lib}-{codec or 'none'}-{uuid.uuid4().hex[:6]}"
    where = f"s3://{args.bucket}/cmp/{tag}" if storage == "s3" else ckpt_dir(f"cmp/{tag}")
    if storage == "local":
        os.makedirs(os.path.dirname(where), exist_ok=True)
    try:
        settle()
        t0 = time.perf_counter()
        libs.save(lib, codec, where, tree, torch_sd)
        save_s = time.perf_counter() - t0
        res: dict[str, Any] = {"save_s": save_s, "bytes": libs.stored_bytes(where)}
        t0 = time.perf_counter()
        out = libs.restore(lib, codec, where, target, torch_sd)
        res["restore_s" if storage == "s3" else "restore_warm_s"] = time.perf_counter() - t0
        if record and args.round == 0:
            res["bit_exact"] = same_values(lib, out, flat)
        del out
        if storage == "local":
            evict(where)
            t0 = time.perf_counter()
            out = libs.restore(lib, codec, where, target, torch_sd)
            res["restore_evicted_s"] = time.perf_counter() - t0
            del out
    finally:
        libs.remove(where)
    if record:
        raw = sum(v.nbytes for v in flat.values())
        emit(what="run", state=args.state, lib=lib, codec=codec or "none", storage=storage,
             round=args.round, raw_bytes=raw, **res)  # fmt: skip


# ---------------------------------------------------------------- driver and tables
def analyze(rows: list[dict[str, Any]]) -> None:
    runs = [r for r in rows if r.get("what") == "run"]
    for r in rows:
        if r.get("what") == "trained":
            print(f"\ntrained state: {r['blocks']} residual blocks, {r['steps']} Adam steps, "
                  f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}, {r['bytes'] / 1e6:.0f} MB")  # fmt: skip
    for lib, storage, why in sorted({(r["lib"], r["storage"], r["why"]) for r in rows
                                     if r.get("what") == "skipped"}):  # fmt: skip
        print(f"\nskipped: {lib} on {storage}: {why}")
    if not runs:
        return
    print(f"\nrounds: {len({r['round'] for r in runs})}; times in seconds, median [min-max]; "
          "ratios paired by round, then the median")  # fmt: skip
    for state in STATES:
        for storage in ("local", "s3"):
            sel = [r for r in runs if r["state"] == state and r["storage"] == storage]
            if not sel:
                continue

            def by_round(lib: str, codec: str | None, sel=sel) -> dict:
                """The rows of one variant on this state and storage, by round."""
                want = codec or "none"
                return {r["round"]: r for r in sel if r["lib"] == lib and r["codec"] == want}

            raw = sel[0]["raw_bytes"]
            times = (
                ("restore_warm_s", "restore_evicted_s") if storage == "local" else ("restore_s",)
            )
            print(f"\n## {state} on {storage} ({raw / 1e6:.0f} MB of arrays)\n")
            head = ["variant", "stored MB", "bytes / raw", "save s", *[t[:-2] + " s" for t in times],
                    "save / no codec", *[t[:-2] + " / no codec" for t in times], "bit-exact"]  # fmt: skip
            print("| " + " | ".join(head) + " |")
            print("|" + "---|" * len(head))
            for lib, codec in VARIANTS:
                mine = by_round(lib, codec)
                if not mine:
                    continue
                plain = by_round(lib, None)

                def ratio(key: str, mine=mine, plain=plain, codec=codec) -> str:
                    v = [mine[k][key] / plain[k][key] for k in mine if k in plain]
                    return spread(v) if codec else "1"

                b = statistics.median(r["bytes"] for r in mine.values())
                exact = [r["bit_exact"] for r in mine.values() if "bit_exact" in r]
                cells = [f"{lib} {codec or 'none'}", f"{b / 1e6:.1f}", f"{b / raw:.3f}",
                         spread([r["save_s"] for r in mine.values()]),
                         *[spread([r[t] for r in mine.values()]) for t in times],
                         ratio("save_s"), *[ratio(t) for t in times],
                         ("yes" if all(exact) else "NO") if exact else ""]  # fmt: skip
                print("| " + " | ".join(cells) + " |")
            base = by_round("snapshard", None)
            print(f"\nagainst snapshard none ({storage}): time ratios, paired by round\n")
            print("| variant | save | " + " | ".join(t[:-2] for t in times) + " |")
            print("|---|---|" + "---|" * len(times))
            for lib, codec in VARIANTS:
                mine = by_round(lib, codec)
                if not mine or (lib == "snapshard" and codec is None):
                    continue
                cells = [spread([mine[k][key] / base[k][key] for k in mine if k in base])
                         for key in ("save_s", *times)]  # fmt: skip
                print(f"| {lib} {codec or 'none'} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=0.1, help="1.0: the 2 GiB peer-bench state")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="Adam steps of the trained state")
    p.add_argument("--no-s3", action="store_true", help="local disk only")
    p.add_argument("--out", default=None, help="JSON lines (default bench/results/...)")
    p.add_argument("--analyze", default=None, help="print the tables of an earlier run")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--state", default=None, help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--bucket", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.analyze:
        with open(args.analyze) as f:
            analyze([json.loads(line) for line in f if line.strip()])
        return
    if args.train:
        force_cpu_devices(8)
        save_trained(train(args.scale, args.steps), trained_path(args.scale, args.steps))
        return
    if args.job:
        return job(args)
    out = args.out or os.path.join(
        HERE, "results", f"compression-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    bucket = None
    if not args.no_s3:
        if os.environ.get("AWS_ENDPOINT_URL"):
            bucket = new_s3_bucket()
        else:
            print("no AWS_ENDPOINT_URL: local disk only (start the S3 server for the S3 rows)")
    rows: list[dict[str, Any]] = []

    def run(extra: list[str]) -> None:
        cmd = [
            sys.executable,
            __file__,
            "--scale",
            str(args.scale),
            "--steps",
            str(args.steps),
            *extra,
        ]
        if bucket:
            cmd += ["--bucket", bucket]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"{' '.join(extra)} failed")
        with open(out, "a") as f:
            for line in done.stdout.splitlines():
                if line.startswith("RESULT "):
                    rows.append(json.loads(line[7:]))
                    f.write(line[7:] + "\n")
                    print(line, flush=True)

    path = trained_path(args.scale, args.steps)
    if not os.path.exists(path) or not os.path.exists(path + ".json"):
        run(["--train"])
    with open(path + ".json") as f:
        rows.append(json.load(f))
    for r in range(args.rounds):
        for state in STATES if r % 2 == 0 else STATES[::-1]:
            run(["--job", "--state", state, "--round", str(r)])
    print(f"\nresults: {out}; scale {args.scale}")
    analyze(rows)


if __name__ == "__main__":
    main()
