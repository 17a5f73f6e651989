"""Save and restore of a sharded pytree on object stores: against orbax-checkpoint on S3 and
GCS, and against each store's plain client on S3, GCS and Azure.

    python bench/bench_objstore.py [--size-mib 1024] [--rounds 3] [--store s3|gs] [--at REV]
    python bench/bench_objstore.py --plain [--stores s3,gs,az] [--rounds 3] [--size-mib N]
                                   [--read-once [--read-once-mib 128]] [--at REV]

--plain: the peer-bench state (24 float32 and 3 bfloat16 arrays of (4096, 5120) and 24
float32 biases of 5120: 2041 MiB; the arrays' rows sharded over 8 CPU devices, the biases
replicated) saved and restored with snapshard on each configured store, and the same bytes
(one object per array) put and got by the store's plain client, 4 at a time (obstore for S3
and Azure, google-cloud-storage for GCS), in interleaved rounds after a warm-up round; it
prints medians, the throughput ratios and the bytes a restore read against those it needed.
A second table has the plain client make snapshard's own requests in the same round: objects
of the sizes of snapshard's data files written the way its store layer writes them (a file
of up to `single_request_bytes` in one request: a media upload on GCS, one PUT on S3 and
Azure; a larger one on GCS as 16 MiB parts, temporary objects, 8 in flight per file, then
compose; on S3 and Azure through obstore's multipart writer; as many files at once as the
library writes), and the very ranged reads its restore made, 4 at a time, on its files. Where snapshard matches that but not one object per array, the cost is the
server's for that pattern of requests, not the library's. --read-once adds
bench_read_once.py's 4-process job (every column band on all 4 processes) on each store:
the job's bytes read against the unique bytes, read-once on and off. In each round the
writes come first, then the reads, each group in reverse order every other round.
--size-mib scales the state down (fewer layers). --at REV measures the library as of that
git commit instead of the working tree (the plain client then follows that version's upload
pattern). The servers and their settings as .ci/run starts and exports them
(../shared/objstore/).

Needs the server (../shared/objstore/s3-server.sh start) and AWS_ENDPOINT_URL, the
credentials and AWS_ALLOW_HTTP=true in the environment (as .ci/run exports them); orbax
needs s3fs for its directory operations (the `bench` extra). With the local Ceph server,
also export CEPH_CONF=<its RGW_DIR>/ceph.conf: the bench then flushes the server's deferred
deletions after each round, without which its memory grows by every byte ever written. The tree is sharded over 8 CPU devices on a (2, 4)
mesh; both libraries save to and restore from the same server, in interleaved rounds
(the order alternates), and the table gives medians, ratios and the requests each made,
counted on the wire by a proxy in a separate run (so that the proxy costs no timed time).

--store gs: the same comparison on GCS (STORAGE_EMULATOR_HOST for the emulator, and for
TensorStore TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING, as .ci/run exports
them); orbax's directory operations on gs:// go through gcsfs (anonymous on an emulator).
Requests are counted on the wire for S3 only (the counting proxy speaks S3).

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


def _library() -> tuple[str, str]:
    """The library measured and its name: with --at REV, as of that git commit (extracted
    for this run); else the working tree's."""
    if "--at" not in sys.argv[:-1]:
        return str(ROOT / "src"), "working tree"
    import atexit
    import tempfile

    sys.path.insert(0, str(ROOT / "bench"))
    from common import library_at

    rev = sys.argv[sys.argv.index("--at") + 1]
    tmp = tempfile.mkdtemp(prefix="snapshard-at-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    return library_at(rev, tmp), rev


LIBRARY, LIBRARY_NAME = _library()
sys.path[:0] = [LIBRARY, str(ROOT / "tests")]

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

    def __init__(self, scheme: str = "s3") -> None:
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.path import atomicity

        if scheme == "s3":
            self._s3_driver()
        elif os.environ.get("STORAGE_EMULATOR_HOST"):
            # gcsfs (orbax's directory operations) reads the emulator's address itself;
            # it needs no credentials there.
            os.environ.setdefault("FSSPEC_GS_TOKEN", "anon")
            os.environ.setdefault("FSSPEC_GCS_TOKEN", "anon")
            # gcsfs's bucket-type probe goes over gRPC, which the emulator does not serve.
            os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        self.ocp = ocp
        self.ckpt = ocp.Checkpointer(
            ocp.PyTreeCheckpointHandler(use_ocdbt=False),
            temporary_path_class=atomicity.CommitFileTemporaryPath,
        )

    @staticmethod
    def _s3_driver() -> None:
        """Point TensorStore's S3 driver at the server (orbax builds no S3 spec itself)."""
        from orbax.checkpoint._src.path import gcs_utils
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


def one_round(lib: Any, url_base: str, tree: Any, target: Any, check: bool) -> tuple[float, float]:
    url = f"{url_base}/{lib.name}-{uuid.uuid4().hex[:8]}/ckpt"
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


PEER_ROWS, PEER_COLS = 4096, 5120
STORE_ENV = {
    "s3": "AWS_ENDPOINT_URL",
    "gs": "STORAGE_EMULATOR_HOST",
    "az": "AZURITE_BLOB_STORAGE_URL",
}


def peer_state(size_mib: int | None) -> dict[str, Any]:
    """The peer-bench state; with size_mib, fewer of its layers (at least one)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    rows, layer = NamedSharding(mesh, P("x", None)), PEER_ROWS * PEER_COLS * 4
    layers = 24 if size_mib is None else max(1, min(24, size_mib * MiB // layer))

    def put(shape, dtype, sharding, seed):
        fn = jax.jit(lambda k: 0.02 * jax.random.normal(k, shape, dtype), out_shardings=sharding)
        return fn(jax.random.key(seed))

    w = [put((PEER_ROWS, PEER_COLS), np.float32, rows, i) for i in range(layers)]
    b = [put((PEER_COLS,), np.float32, NamedSharding(mesh, P()), 100 + i) for i in range(layers)]
    embed = [put((PEER_ROWS, PEER_COLS), jax.numpy.bfloat16, rows, 200 + i) for i in range(3)]
    return {"layers": [{"w": a, "b": c} for a, c in zip(w, b, strict=True)], "embed": embed}


class PlainClient:
    """The store's own client moving whole objects, `threads` at a time."""

    threads = 4

    def __init__(self, scheme: str, bucket: str):
        from concurrent.futures import ThreadPoolExecutor

        self.scheme = scheme
        self.pool = ThreadPoolExecutor(self.threads)
        if scheme == "gs":
            from google.cloud import storage

            self.blobs = storage.Client().bucket(bucket)
            self.put_one = lambda key, data: self.blobs.blob(key).upload_from_string(data)
            self.get_one = lambda key: self.blobs.blob(key).download_as_bytes()
            self.get_range = lambda key, start, n: self.blobs.blob(key).download_as_bytes(
                start=start, end=start + n - 1
            )
        else:
            import obstore

            from snapshard.storage.obstore_bucket import make_store

            self.store = make_store(scheme, bucket, None)
            self.put_one = lambda key, data: obstore.put(self.store, key, data)
            self.get_one = lambda key: obstore.get(self.store, key).bytes()
            self.get_range = lambda key, start, n: obstore.get_range(
                self.store, key, start=start, end=start + n
            )

    def put(self, prefix: str, objects: list[bytes]) -> None:
        list(
            self.pool.map(lambda i: self.put_one(f"{prefix}/{i}", objects[i]), range(len(objects)))
        )

    def get(self, prefix: str, n: int) -> int:
        return sum(len(b) for b in self.pool.map(lambda i: self.get_one(f"{prefix}/{i}"), range(n)))

    def get_ranges(self, ranges: list[tuple[str, int, int]]) -> int:
        """The given (key, start, length) ranged reads, `threads` at a time."""
        return sum(len(b) for b in self.pool.map(lambda r: self.get_range(*r), ranges))

    def put_files(self, prefix: str, data: memoryview, sizes: list[int]) -> None:
        """Objects of these sizes written the way the measured library's store layer writes
        its data files (see upload_pattern), `at_once` files at a time."""
        from concurrent.futures import ThreadPoolExecutor

        single, at_once = upload_pattern(sizes)
        starts = np.cumsum([0, *sizes]).tolist()
        with ThreadPoolExecutor(at_once) as files:
            list(
                files.map(
                    lambda i: self._put_file(
                        f"{prefix}/f{i}", data[starts[i] : starts[i] + sizes[i]], single
                    ),
                    range(len(sizes)),
                )
            )

    def _put_file(self, key: str, data: memoryview, single: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        part, parallel = 16 * MiB, 8
        if self.scheme != "gs":
            import obstore

            if len(data) <= single:  # one PUT
                obstore.put(self.store, key, [data], use_multipart=False)
                return
            w = obstore.open_writer(self.store, key, buffer_size=part, max_concurrency=parallel)
            w.write(data)
            w.close()
            return
        if len(data) <= single:  # one media upload, as google-resumable-media sends it
            from urllib.parse import quote

            from google.resumable_media.requests import SimpleUpload

            client = self.blobs.client
            url = f"{client.api_endpoint}/upload/storage/v1/b/{self.blobs.name}/o"
            url += f"?uploadType=media&name={quote(key, safe='')}"
            SimpleUpload(url).transmit(client._http, bytes(data), "application/octet-stream")
            return
        names = [f"{key}.part{i:05d}" for i in range(-(-len(data) // part))]

        def one(i: int) -> None:
            piece = bytes(data[i * part : (i + 1) * part])
            chunk = -(-len(piece) // (256 << 10)) * (256 << 10)
            self.blobs.blob(names[i], chunk_size=chunk).upload_from_string(piece)

        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(one, range(len(names))))
        self.blobs.blob(key).compose([self.blobs.blob(n) for n in names])
        for n in names:
            self.blobs.delete_blob(n)


def upload_pattern(sizes: list[int]) -> tuple[int, int]:
    """How the measured library uploads a save's data files of these sizes with its default
    settings: the largest file it sends in one request (larger ones: on GCS 16 MiB parts as
    temporary objects, 8 in flight per file, then one compose; on S3 and Azure obstore's
    multipart writer), and how many files it writes at once (2 writers, each with as many
    files in flight as part_size * (upload_concurrency + 1) bytes hold at the size of the
    largest). Versions before one-request files: files of less than a part went in one
    request, every file written at once."""
    from snapshard.storage.bucket import TransferConfig

    t = TransferConfig()
    single = getattr(t, "single_request_bytes", t.part_size - 1)
    if getattr(t, "file_bytes", None) is None:
        return single, len(sizes)
    per_writer = max(1, t.part_size * (t.upload_concurrency + 1) // max(1, *sizes))
    return single, max(1, min(len(sizes), 2 * per_writer))


class ReadRecorder:
    """Records the ranged reads (key, start, length) a restore asks of a store's bucket
    class, to replay them with the plain client (a list append per request: not timed
    apart)."""

    def __init__(self, scheme: str):
        if scheme == "gs":
            from snapshard.storage.gcs_bucket import GcsBucket as cls
        else:
            from snapshard.storage.obstore_bucket import ObstoreBucket as cls
        self.cls = cls
        self.ranges: list[tuple[str, int, int]] = []

    def __enter__(self) -> ReadRecorder:
        original = self.cls.read_range_into
        self._original = self.cls.__dict__.get("read_range_into")
        ranges = self.ranges

        def recorded(bucket: Any, key: str, start: int, views: Any) -> int:
            ranges.append((key, start, sum(len(v) for v in views)))
            return original(bucket, key, start, views)

        self.cls.read_range_into = recorded
        return self

    def __exit__(self, *exc: object) -> None:
        if self._original is None:
            del self.cls.read_range_into
        else:
            self.cls.read_range_into = self._original


def bucket_of(scheme: str) -> str:
    if scheme == "s3":
        from s3env import create_bucket

        return create_bucket("snapshard-bench")
    var = "GCS_BUCKETS" if scheme == "gs" else "AZURE_CONTAINERS"
    return os.environ.get(var, "ckpt").split(",")[0]


def timed(out: dict[str, float], name: str, fn: Any) -> Any:
    t0 = time.perf_counter()
    result = fn()
    out[name] = time.perf_counter() - t0
    return result


def plain_round(
    scheme: str, bucket: str, tree: Any, host: list[bytes], sizes: list[int], flip: bool
) -> tuple[dict[str, float], list[int]]:
    """One round: the writes (snapshard's save; the plain client writing objects of the
    sizes of snapshard's data files, `sizes` as the last save left them, the way snapshard
    writes them; the state's arrays as objects of their own), then the reads (snapshard's
    restore and the plain client's replay of its ranged reads; the arrays' objects), each
    group in reverse order when `flip`, so that no one always goes first. Returns the
    times and the data files' sizes."""
    import snapshard
    from snapshard.storage.object_client import ObjectClient

    tag = uuid.uuid4().hex[:8]
    url = f"{scheme}://{bucket}/bench-{tag}/ckpt"
    prefix = f"plain-{tag}"
    plain = PlainClient(scheme, bucket)
    flat = memoryview(b"".join(host))
    out: dict[str, float] = {}
    writes = [
        lambda: timed(out, "save", lambda: snapshard.save(url, tree)),
        lambda: timed(out, "same_put", lambda: plain.put_files(f"{prefix}/same", flat, sizes)),
        lambda: timed(out, "put", lambda: plain.put(prefix, host)),
    ]
    for write in writes[::-1] if flip else writes:
        write()
    stats = snapshard.ReadStats()

    def snapshard_reads() -> None:
        with ReadRecorder(scheme) as reads:
            timed(out, "restore", lambda: jax.block_until_ready(
                snapshard.load(url, abstract(tree), stats=stats)
            ))  # fmt: skip
        got = timed(out, "same_get", lambda: plain.get_ranges(reads.ranges))
        assert got == sum(n for _, _, n in reads.ranges)

    def plain_reads() -> None:
        got = timed(out, "get", lambda: plain.get(prefix, len(host)))
        assert got == sum(len(h) for h in host)

    for read in [plain_reads, snapshard_reads] if flip else [snapshard_reads, plain_reads]:
        read()
    out["read_ratio"] = stats.bytes_read / stats.bytes_needed
    files = ObjectClient(url).listing()
    sizes = [n for name, n in sorted(files.items()) if name.startswith("data/")]
    remove(url.rsplit("/", 1)[0])
    remove(f"{scheme}://{bucket}/{prefix}")
    return out, sizes


def read_once_check(args: argparse.Namespace, stores: list[str]) -> None:
    """bench_read_once.py's 4-process job (4 processes x 2 CPU devices, every column band on
    all 4) against each store: the bytes the job read with read-once on and off, against
    the unique bytes."""
    import json
    import tempfile

    print("\n| store | read-once | bytes read / unique (median) | restore s (median) |")
    print("| --- | --- | --- | --- |")
    for s in stores:
        url = f"{s}://{bucket_of(s)}/read-once-{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.jsonl")
            cmd = [sys.executable, str(ROOT / "bench" / "bench_read_once.py"), "--s3", url]
            cmd += ["--mb", str(args.read_once_mib), "--rounds", str(args.rounds + 1)]
            cmd += ["--dir", os.path.join(tmp, "local"), "--out", out]
            env = dict(os.environ, PYTHONPATH=LIBRARY)
            job = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
            if job.returncode:
                raise SystemExit(f"bench_read_once.py on {url} failed:\n{job.stderr[-4000:]}")
            with open(out) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        remove(url)
        for mode in ("on", "off"):
            mine = [r for r in rows if r["storage"] == "s3" and r["mode"] == mode]
            ratio = statistics.median(r["bytes_read"] / r["unique"] for r in mine)
            secs = statistics.median(r["seconds"] for r in mine[1:] or mine)
            ok = "" if all(r["ok"] for r in mine) else " (values differ!)"
            print(f"| {s} | {mode} | {ratio:.3f}{ok} | {secs:.2f} |")


def plain_bench(args: argparse.Namespace) -> None:
    stores = [s for s in args.stores.split(",") if os.environ.get(STORE_ENV[s])]
    if not stores:
        raise SystemExit(f"no store configured: set one of {sorted(STORE_ENV.values())}")
    tree = peer_state(args.size_mib if args.size_mib != 1024 else None)
    host = [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]
    size = sum(len(h) for h in host) / MiB
    print(
        f"state: {size:.0f} MiB, {len(host)} leaves; stores {stores}; library: {LIBRARY_NAME}",
        flush=True,
    )
    buckets = {s: bucket_of(s) for s in stores}
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in stores}
    # Round 0 warms up; its same-requests writes guess two files of half the state each.
    sizes = {s: [sum(len(h) for h in host) // 2] * 2 for s in stores}
    for r in range(args.rounds + 1):
        for s in stores if r % 2 == 0 else stores[::-1]:
            res, sizes[s] = plain_round(s, buckets[s], tree, host, sizes[s], flip=r % 2 == 1)
            print(
                f"round {r} {s}: " + ", ".join(f"{k} {v:.2f}" for k, v in res.items()), flush=True
            )
            if r:
                runs[s].append(res)
    print()
    print(
        "| store | save (s) | plain put (s) | save / put throughput | restore (s) | "
        "plain get (s) | restore / get throughput | read / needed |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    medians = {s: {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]} for s in stores}
    for s, m in medians.items():
        print(
            f"| {s} | {m['save']:.2f} | {m['put']:.2f} | {m['put'] / m['save']:.2f} | "
            f"{m['restore']:.2f} | {m['get']:.2f} | {m['get'] / m['restore']:.2f} | "
            f"{m['read_ratio']:.3f} |"
        )
    print(
        "\nThe plain client making snapshard's requests (its files' sizes and upload pattern; "
        "its restore's ranged reads, 4 at a time), against one object per array:\n"
    )
    print(
        "| store | same-requests put (s) | save / same-requests | same-requests put / put | "
        "same-requests get (s) | restore / same-requests | same-requests get / get |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s, m in medians.items():
        print(
            f"| {s} | {m['same_put']:.2f} | {m['same_put'] / m['save']:.2f} | "
            f"{m['put'] / m['same_put']:.2f} | {m['same_get']:.2f} | "
            f"{m['same_get'] / m['restore']:.2f} | {m['get'] / m['same_get']:.2f} |"
        )
    if args.read_once:
        read_once_check(args, stores)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="approximate size of the tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket", default=None, help="an existing bucket (default: a new one)")
    ap.add_argument("--plain", action="store_true", help="against each store's plain client")
    ap.add_argument("--stores", default="s3,gs,az", help="with --plain: the stores to measure")
    ap.add_argument(
        "--read-once", action="store_true",
        help="with --plain: also bench_read_once.py's 4-process job on each store",
    )  # fmt: skip
    ap.add_argument(
        "--read-once-mib", type=int, default=128,
        help="the state of the read-once job (4 processes each hold all of it)",
    )  # fmt: skip
    ap.add_argument("--store", default="s3", choices=("s3", "gs"), help="against orbax: where")
    ap.add_argument(
        "--at", default=None, metavar="REV",
        help="measure the library as of this git commit, not the working tree",
    )  # fmt: skip
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain:
        return plain_bench(args)
    if args.store == "s3" and not os.environ.get("AWS_ENDPOINT_URL"):
        raise SystemExit("set AWS_ENDPOINT_URL and the credentials of the S3 server first")
    if args.child:
        return child(args)
    bucket = args.bucket or bucket_of(args.store)
    tree = build_tree(args.size_mib)
    target = abstract(tree)
    libs = [Snapshard(), Orbax(args.store)]
    print(
        f"tree: {nbytes(tree) / MiB:.0f} MiB, {len(jax.tree_util.tree_leaves(tree))} leaves, "
        f"mesh (2, 4) of 8 CPU devices; {args.store}://{bucket}; library: {LIBRARY_NAME}",
        flush=True,
    )
    times: dict[str, dict[str, list[float]]] = {
        lib.name: {"save": [], "restore": []} for lib in libs
    }
    for r in range(args.rounds + 1):  # round 0 warms up (compilation, connections)
        order = libs if r % 2 == 0 else libs[::-1]
        for lib in order:
            s, t = one_round(lib, f"{args.store}://{bucket}", tree, target, check=(r == 0))
            if r:
                times[lib.name]["save"].append(s)
                times[lib.name]["restore"].append(t)
            print(f"round {r} {lib.name}: save {s:.2f} s, restore {t:.2f} s", flush=True)
    counts = count_requests(args, bucket) if args.store == "s3" else None
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
        mine, theirs = (
            (fmt_counts(counts["snapshard"][phase]), fmt_counts(counts["orbax"][phase]))
            if counts
            else ("not counted", "not counted")
        )
        print(f"| {phase} | {a:.2f} | {b:.2f} | {b / a:.2f} | {size / a:.0f} | {mine} | {theirs} |")


if __name__ == "__main__":
    main()
