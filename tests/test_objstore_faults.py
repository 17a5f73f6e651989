"""Faults on the wire, injected by a proxy in front of the local S3 server.

Transient failures (5xx, dropped connections, cut downloads, timeouts) are retried and the
save and restore still come out bit-exact; retries are bounded; permanent failures fail at
the first answer; a failed save leaves nothing visible. Request counters match the wire.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import numpy as np
import pytest

import snapshard
from faultproxy import FaultProxy
from s3env import ENDPOINT_VAR
from snapshard.errors import StorageError
from snapshard.storage.bucket import TransferConfig
from snapshard.storage.objstore import COMMIT_MARKER, ObjectRoot, ObjectStorage

from conftest import mesh, sharded

pytestmark = pytest.mark.s3

MAX_RETRIES = 3
FAST_RETRY = {
    "max_retries": MAX_RETRIES,
    "backoff": {
        "init_backoff": timedelta(milliseconds=20),
        "max_backoff": timedelta(milliseconds=200),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=30),
}
# Files of more than one part go up as multipart uploads (none cut to fit one request).
SMALL = TransferConfig(
    part_size=5 << 20, single_request_bytes=5 << 20, file_bytes=None, read_part_size=2 << 20
)


@pytest.fixture
def proxy(s3_bucket):
    with FaultProxy(os.environ[ENDPOINT_VAR]) as p:
        yield p


@pytest.fixture
def base(s3_bucket):
    return f"s3://{s3_bucket}/{uuid.uuid4().hex[:12]}"


# A save's data cut into files of at most 4 MiB, each sent in one PUT.
ONE_REQUEST = TransferConfig(
    single_request_bytes=4 << 20, file_bytes=4 << 20, read_part_size=2 << 20
)


def through(proxy: FaultProxy, url: str, transfer: TransferConfig = SMALL) -> ObjectStorage:
    options = {
        "endpoint": proxy.url,
        "client_options": {"allow_http": True, "timeout": "2s", "connect_timeout": "2s"},
        "retry_config": FAST_RETRY,
    }
    return ObjectStorage(url, options, transfer=transfer)


def tree():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1536, 2048), dtype=np.float32)  # 12 MiB: multipart uploads
    return w, {"w": sharded(w, mesh(2, 4), "data", "model"), "n": 5}


def test_transient_failures_are_retried_and_the_result_is_bit_exact(proxy, base):
    st = through(proxy, f"{base}/ckpt")
    rules = [
        proxy.add("POST", "uploads", "status", status=500),  # multipart create
        proxy.add("PUT", "partNumber", "status", times=2, status=503),  # parts
        proxy.add("PUT", "/index/", "reset"),  # dropped connection
        proxy.add("GET", "list-type", "status", status=503),  # listing
        proxy.add("HEAD", COMMIT_MARKER, "status", status=503),
        proxy.add("PUT", "manifest.json", "delay", delay_s=3),  # client timeout (2 s)
    ]
    w, t = tree()
    snapshard.save(st, t)
    rules += [
        proxy.add("GET", "/data/", "cut"),  # download cut in the middle
        proxy.add("GET", "/data/", "reset"),
        proxy.add("GET", "/data/", "delay", delay_s=3),
        proxy.add("GET", "manifest.json", "status", status=500),
    ]
    out = snapshard.load(st, {"w": t["w"], "n": 0})
    assert np.asarray(out["w"]).tobytes() == w.tobytes() and out["n"] == 5
    assert [r.fired for r in rules] == [r.times for r in rules], "every fault was injected"
    # Each fault cost one more request on the wire than snapshard issued.
    on_wire = sum(proxy.requests.values())
    assert on_wire == st.stats.requests + sum(r.times for r in rules)
    assert ObjectRoot(base).list() == {"ckpt": True}


@pytest.mark.parametrize("transfer", [SMALL, ONE_REQUEST], ids=["multipart", "one_request"])
def test_retries_are_bounded_and_the_failed_save_leaves_nothing(proxy, base, transfer):
    st = through(proxy, f"{base}/ckpt", transfer)
    proxy.add("PUT", "/data/", "status", times=10_000, status=503)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=rf"{base}/ckpt: upload of 'data/.*' failed"):
        snapshard.save(st, tree()[1])
    assert time.monotonic() - t0 < 30
    attempts: dict[str, int] = {}
    for method, path in proxy.log:
        if method == "PUT" and "/data/" in path:
            attempts[path] = attempts.get(path, 0) + 1
    assert attempts and max(attempts.values()) == MAX_RETRIES + 1
    assert ObjectRoot(base).list() == {}
    assert ObjectStorage(f"{base}/ckpt").client.listing() == {}


def test_permanent_failures_fail_at_the_first_answer_and_leave_nothing(proxy, base):
    st = through(proxy, f"{base}/ckpt")
    proxy.add("PUT", COMMIT_MARKER, "status", times=10_000, status=403)
    with pytest.raises(StorageError, match=rf"{base}/ckpt: access denied to write of 'COMMITTED'"):
        snapshard.save(st, tree()[1])
    assert [p for m, p in proxy.log if m == "PUT" and COMMIT_MARKER in p] != []
    assert sum(1 for m, p in proxy.log if m == "PUT" and COMMIT_MARKER in p) == 1
    assert ObjectRoot(base).list() == {}
    assert ObjectStorage(f"{base}/ckpt").client.listing() == {}


def test_request_counts_match_the_wire_and_the_marker_is_written_last(proxy, base):
    st = through(proxy, f"{base}/ckpt")
    _, t = tree()
    snapshard.save(st, t)
    saved = st.stats
    puts = [p for m, p in proxy.log if m == "PUT"]
    assert puts[-1].endswith(f"/ckpt/{COMMIT_MARKER}")
    assert puts[-2].endswith("/ckpt/manifest.json")
    wire = dict(proxy.requests)
    proxy.clear()
    snapshard.load(st, {"w": t["w"], "n": 0})
    loaded = st.stats - saved
    for stats, seen in ((saved, wire), (loaded, dict(proxy.requests))):
        assert seen.get("PUT", 0) == stats.put
        assert seen.get("POST", 0) == stats.post
        assert seen.get("HEAD", 0) == stats.head
        assert seen.get("GET", 0) == stats.get + stats.list  # a listing is a GET
        assert seen.get("DELETE", 0) == stats.delete
    assert saved.post == 4 and loaded.get >= 8  # 2 multipart files; reads split in 2 MiB


def test_a_file_that_fits_one_request_is_one_put_on_the_wire(proxy, base):
    st = through(proxy, f"{base}/ckpt", ONE_REQUEST)
    w, t = tree()
    timings = snapshard.save(st, t)
    saved = st.stats
    data = [p for m, p in proxy.log if m == "PUT" and "/data/" in p]
    # 12 MiB in 8 boxes of 1.5 MiB: 4 files of 3 MiB, each one PUT, no multipart request.
    assert timings.data_files == len(data) == len(set(data)) == 4
    assert not [p for _, p in proxy.log if "uploadId" in p or "uploads" in p]
    assert proxy.requests.get("POST", 0) == saved.post == 0
    assert proxy.requests["PUT"] == saved.put == len(data) + 3  # record, manifest, marker
    out = snapshard.load(st, {"w": t["w"], "n": 0})
    assert np.asarray(out["w"]).tobytes() == w.tobytes()
