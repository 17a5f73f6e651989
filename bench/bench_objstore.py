"""Save and restore of a sharded pytree to the local S3 server: snapshard vs orbax-checkpoint.

    python bench/bench_objstore.py [--size-mib 1024] [--rounds 3]

Needs the server (../shared/objstore/s3-server.sh start) and AWS_ENDPOINT_URL, the
credentials and AWS_ALLOW_HTTP=true in the environment (as .ci/run exports them); orbax
needs s3fs for its directory operations (the `bench` extra). With the local Ceph server,
also export CEPH_CONF=<its RGW_DIR>/ceph.conf: the bench then flushes the server's deferred
deletions after each round, without which its memory grows by every byte ever written. The tree is sharded over 8 CPU devices on a (2, 4)
mesh; both libraries save to and restore from the same server, in interleaved rounds
(the order alternates), and the table gives medians, ratios and the requests each made,
counted on the wire by a proxy in a separate run (so that the proxy costs no timed time).

orbax-checkpoint 0.12.8 on S3, as configured here: its TensorStore S3 driver pointed at the
server's endpoint (orbax builds no S3 spec itself, so the bench adds one), zarr rather than
OCDBT (OCDBT updates its manifest with If-Match, which this server version answers with 412),
and its commit-file protocol (CommitFileTemporaryPath, what it uses on GCS) since S3 has no
rename.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

MiB = 1 << 20


def build_tree(size_mib: int) -> dict[str, Any]:
    """A transformer-like tree of about size_mib MiB on a (2, 4) mesh."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    d = 2048 if size_mib >= 512 else 512
    per_layer = (4 * d * d * 4) * 2 + 3 * d * d * 2  # w1, w2 float32; attn bfloat16
    embed_rows = 16 * d
    layers = max(1, round((size_mib * MiB - embed_rows * d * 4) / per_layer))
    rng = np.random.default_rng(0)

    def put(shape, dtype, *spec):
        s = NamedSharding(mesh, P(*spec))
        return jax.jit(lambda k: jax.random.normal(k, shape, dtype=dtype), out_shardings=s)(
            jax.random.key(int(rng.integers(1 << 30)))
        )

    return {
        "embed": put((embed_rows, d), np.float32, "model", None),
        "layers": [
            {
                "w1": put((d, 4 * d), np.float32, "data", "model"),
                "w2": put((4 * d, d), np.float32, "model", "data"),
                "attn": put((d, 3 * d), jax.numpy.bfloat16, None, "model"),
                "ln": put((d,), np.float32),
            }
            for _ in range(layers)
        ],
        "step": 1000,
    }


def nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "nbytes"))


def abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        tree,
    )


class Snapshard:
    name = "snapshard"

    def save(self, url: str, tree: Any) -> None:
        import snapshard

        snapshard.save(url, tree)

    def restore(self, url: str, target: Any) -> Any:
        import snapshard

        return snapshard.load(url, target)


class Orbax:
    name = "orbax"

    def __init__(self) -> None:
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.path import atomicity, gcs_utils
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

        endpoint = os.environ["AWS_ENDPOINT_URL"]
        region = os.environ.get("AWS_REGION", "us-east-1")
        norm, use_native, native_spec = (
            tsu._normalize_path,
            tsu._use_gcs_driver,
            gcs_utils.get_kvstore_for_gcs,
        )

        def s3_spec(path: str) -> dict[str, Any]:
            if not path.startswith("s3://"):
                return native_spec(path)
            bucket, _, key = path[5:].partition("/")
            return {
                "driver": "s3",
                "bucket": bucket,
                "path": key,
                "endpoint": endpoint,
                "aws_region": region,
            }

        tsu._normalize_path = lambda p: (
            norm(p).replace("s3:/", "s3://", 1) if p.startswith("s3://") else norm(p)
        )
        tsu._use_gcs_driver = lambda p: p.startswith("s3://") or use_native(p)
        gcs_utils.get_kvstore_for_gcs = s3_spec
        self.ocp = ocp
        self.ckpt = ocp.Checkpointer(
            ocp.PyTreeCheckpointHandler(use_ocdbt=False),
            temporary_path_class=atomicity.CommitFileTemporaryPath,
        )

    def save(self, url: str, tree: Any) -> None:
        self.ckpt.save(url, args=self.ocp.args.PyTreeSave(tree))

    def restore(self, url: str, target: Any) -> Any:
        args = self.ocp.checkpoint_utils.construct_restore_args(target)
        return self.ckpt.restore(url, args=self.ocp.args.PyTreeRestore(target, restore_args=args))


def remove(url: str) -> None:
    """Delete everything under url; on the local Ceph server (CEPH_CONF set), also run its
    deferred garbage collection, which otherwise keeps deleted multipart data in memory."""
    from snapshard.storage.object_client import ObjectClient

    client = ObjectClient(url)
    client.delete(sorted(client.listing()))
    if os.environ.get("CEPH_CONF") and shutil.which("radosgw-admin"):
        gc = ["radosgw-admin", "-n", "client.admin", "gc", "process", "--include-all"]
        subprocess.run(gc, check=True, capture_output=True, timeout=300)


def same(a: Any, b: Any) -> bool:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb, strict=True)
    )


def one_round(lib: Any, bucket: str, tree: Any, target: Any, check: bool) -> tuple[float, float]:
    url = f"s3://{bucket}/{lib.name}-{uuid.uuid4().hex[:8]}/ckpt"
    t0 = time.perf_counter()
    lib.save(url, tree)
    t1 = time.perf_counter()
    out = lib.restore(url, target)
    jax.block_until_ready(out)
    t2 = time.perf_counter()
    if check and not same(out, tree):
        raise SystemExit(f"{lib.name}: restored tree differs from the saved one")
    del out
    remove(url.rsplit("/", 1)[0])
    return t1 - t0, t2 - t1


def count_requests(args: argparse.Namespace, bucket: str) -> dict[str, dict[str, int]]:
    """Save and restore once per library in a child process whose endpoint is a counting proxy."""
    from faultproxy import FaultProxy

    out = {}
    with FaultProxy(os.environ["AWS_ENDPOINT_URL"]) as proxy:
        for lib in ("snapshard", "orbax"):
            counts = {}
            for phase in ("save", "restore"):
                proxy.clear()
                env = dict(os.environ, AWS_ENDPOINT_URL=proxy.url)
                cmd = [sys.executable, __file__, "--size-mib", str(args.size_mib)]
                cmd += ["--child", lib, phase, bucket]
                subprocess.run(cmd, env=env, check=True)
                counts[phase] = dict(proxy.requests)
            remove(f"s3://{bucket}/count-{lib}")
            out[lib] = counts
    return out


def child(args: argparse.Namespace) -> None:
    lib_name, phase, bucket = args.child
    lib = Snapshard() if lib_name == "snapshard" else Orbax()
    tree = build_tree(args.size_mib)
    url = f"s3://{bucket}/count-{lib_name}/ckpt"
    if phase == "save":
        lib.save(url, tree)
    else:
        jax.block_until_ready(lib.restore(url, abstract(tree)))


def fmt_counts(c: dict[str, int]) -> str:
    total = sum(c.values())
    parts = ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
    return f"{total} ({parts})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="approximate size of the tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket", default=None, help="an existing bucket (default: a new one)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not os.environ.get("AWS_ENDPOINT_URL"):
        raise SystemExit("set AWS_ENDPOINT_URL and the credentials of the S3 server first")
    if args.child:
        return child(args)
    from s3env import create_bucket

    bucket = args.bucket or create_bucket("snapshard-bench")
    tree = build_tree(args.size_mib)
    target = abstract(tree)
    libs = [Snapshard(), Orbax()]
    print(
        f"tree: {nbytes(tree) / MiB:.0f} MiB, {len(jax.tree_util.tree_leaves(tree))} leaves, "
        f"mesh (2, 4) of 8 CPU devices; bucket {bucket}",
        flush=True,
    )
    times: dict[str, dict[str, list[float]]] = {
        lib.name: {"save": [], "restore": []} for lib in libs
    }
    for r in range(args.rounds + 1):  # round 0 warms up (compilation, connections)
        order = libs if r % 2 == 0 else libs[::-1]
        for lib in order:
            s, t = one_round(lib, bucket, tree, target, check=(r == 0))
            if r:
                times[lib.name]["save"].append(s)
                times[lib.name]["restore"].append(t)
            print(f"round {r} {lib.name}: save {s:.2f} s, restore {t:.2f} s", flush=True)
    counts = count_requests(args, bucket)
    size = nbytes(tree) / MiB
    print()
    print(
        "| phase | snapshard (median s) | orbax (median s) | orbax / snapshard | "
        "snapshard MiB/s | snapshard requests | orbax requests |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for phase in ("save", "restore"):
        a = statistics.median(times["snapshard"][phase])
        b = statistics.median(times["orbax"][phase])
        print(
            f"| {phase} | {a:.2f} | {b:.2f} | {b / a:.2f} | {size / a:.0f} | "
            f"{fmt_counts(counts['snapshard'][phase])} | {fmt_counts(counts['orbax'][phase])} |"
        )


if __name__ == "__main__":
    main()
