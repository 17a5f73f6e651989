"""GCS uploads against the emulator (fake-gcs-server, marked `gcs`).

A file of up to `single_request_bytes` goes up in one media upload, checked against the
CRC32C GCS reports. A larger file goes up as temporary part objects composed into the file:
it comes back bit-exact (one compose, and a tree of composes for more than 32 sources), no
part is left after a success or after a failure at any of its calls, and nothing of a save
is visible before its marker.
"""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import snapshard
from faultinject import INJECTED, FaultInjector
from s3env import fresh_prefix
from snapshard.errors import CorruptCheckpointError, StorageError
from snapshard.storage import gcs_bucket
from snapshard.storage.bucket import TransferConfig
from snapshard.storage.object_client import ObjectClient
from snapshard.storage.object_writer import PartWriter
from snapshard.storage.objstore import COMMIT_MARKER, ObjectRoot, ObjectStorage

from conftest import mesh, sharded

pytestmark = pytest.mark.gcs

PART = 5 << 20
# Files of more than one part go up as composite uploads (none cut to fit one request).
SMALL = TransferConfig(
    part_size=PART, upload_concurrency=3, single_request_bytes=PART, file_bytes=None
)


@pytest.fixture
def prefix(request) -> str:
    return fresh_prefix(request, "gs")


def payload(parts: float) -> bytes:
    """Random bytes, `parts` parts long (a tail of less than a part included)."""
    return np.random.default_rng(5).bytes(int(parts * PART))


def upload(client: ObjectClient, rel: str, data: bytes) -> None:
    """Through the part writer, in pieces that do not line up with the parts."""
    writer = PartWriter(client, rel)
    try:
        view = memoryview(data)
        for i in range(0, len(view), 3 << 20):
            writer.write(view[i : i + (3 << 20)])
        writer.close()
    except BaseException:
        writer.abort()
        raise


def parts_left(client: ObjectClient) -> list[str]:
    return [name for name in client.listing() if ".part-" in name]


def test_a_file_that_fits_one_request_is_one_media_upload(prefix, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("a file of one request went up in parts")

    monkeypatch.setattr(gcs_bucket.GcsBucket, "upload_part", never)
    monkeypatch.setattr(gcs_bucket.GcsBucket, "compose", never)
    sent: list[str] = []
    transmit = gcs_bucket.SimpleUpload.transmit

    def watch(self, *args, **kwargs):
        sent.append(self.upload_url)
        return transmit(self, *args, **kwargs)

    monkeypatch.setattr(gcs_bucket.SimpleUpload, "transmit", watch)
    client = ObjectClient(prefix, transfer=TransferConfig(single_request_bytes=8 << 20))
    data = payload(1.5)  # 7.5 MiB, written in pieces of 3 MiB
    before = client.stats
    upload(client, "data/f.bin", data)
    spent = client.stats - before
    assert (spent.put, spent.post, spent.delete, spent.bytes_sent) == (1, 0, 0, len(data))
    assert len(sent) == 1 and "uploadType=media" in sent[0] and "name=" in sent[0]
    assert client.get("data/f.bin") == data
    assert client.listing() == {"data/f.bin": len(data)}


def test_a_one_request_upload_whose_crc32c_differs_fails_and_leaves_nothing(prefix, monkeypatch):
    # The CRC32C computed of the bytes sent, made wrong: GCS's own differs from it.
    crc = gcs_bucket.google_crc32c.value
    monkeypatch.setattr(gcs_bucket.google_crc32c, "value", lambda data: crc(data) ^ 1)
    client = ObjectClient(prefix)
    with pytest.raises(StorageError, match=r"upload of .f\.bin. failed .*CRC32C"):
        upload(client, "f.bin", payload(0.5))
    assert client.listing() == {}


@pytest.mark.parametrize("max_compose", [32, 3])
def test_a_file_of_several_parts_round_trips_bit_exact(prefix, monkeypatch, max_compose):
    # 3 sources a compose: 8 parts become a tree of two levels (3 + 3 + 2, then 3).
    monkeypatch.setattr(gcs_bucket, "MAX_COMPOSE", max_compose)
    client = ObjectClient(prefix, transfer=SMALL)
    data = payload(7.4)
    before = client.stats
    upload(client, "data/f.bin", data)
    assert client.get("data/f.bin") == data
    assert client.listing() == {"data/f.bin": len(data)}
    spent = client.stats - before
    composes = 1 if max_compose == 32 else 4
    assert spent.delete == 8 + composes - 1  # every part and every intermediate object


def test_a_file_of_one_part_goes_up_without_parts(prefix):
    client = ObjectClient(prefix, transfer=SMALL)
    data = payload(0.6)
    before = client.stats
    upload(client, "one.bin", data)
    assert client.get("one.bin") == data
    spent = client.stats - before
    assert (spent.post, spent.put, spent.delete) == (0, 1, 0)


@pytest.mark.parametrize(
    "op, k",
    [
        ("s3.upload_part", 0),  # the first part, in the upload's threads
        ("s3.upload_part", 5),  # a later one, while others are in flight
        ("s3.close_upload", 0),  # every part up, nothing composed
        ("s3.compose", 0),  # an intermediate compose
        ("s3.compose", 3),  # the last compose
        ("s3.delete", 2),  # removing the parts after the file is whole
    ],
)
def test_a_failure_at_any_call_of_an_upload_leaves_no_part(prefix, monkeypatch, op, k):
    monkeypatch.setattr(gcs_bucket, "MAX_COMPOSE", 3)
    injector = FaultInjector().install(monkeypatch)
    client = ObjectClient(prefix, transfer=SMALL)
    injector.arm(op, k)
    with pytest.raises(StorageError, match=rf"upload of 'f.bin' failed .*{INJECTED}"):
        upload(client, "f.bin", payload(7.4))
    assert injector.fired is not None and injector.fired.startswith(f"{op} #{k}")
    assert parts_left(client) == []
    if op != "s3.delete":  # a failed clean-up after the last compose: the file is whole
        assert client.listing() == {}


def test_a_failed_compose_is_cleaned_up_after_the_composes_beside_it(prefix, monkeypatch):
    """An intermediate compose fails while the others of its level still run: the clean-up
    deletes the upload's objects only once they have ended (else an object made after its
    name was deleted would be left behind)."""
    from google.api_core.exceptions import ServiceUnavailable

    monkeypatch.setattr(gcs_bucket, "MAX_COMPOSE", 3)
    compose, delete = gcs_bucket.GcsBucket.compose, gcs_bucket.GcsBucket.delete
    running, at_delete = [0], []

    def slow_compose(self: gcs_bucket.GcsBucket, key: str, sources: list[str]) -> None:
        if key.endswith("-1-00000"):
            raise ServiceUnavailable(f"{INJECTED}: compose of {key}")
        running[0] += 1
        try:
            time.sleep(0.3)
            compose(self, key, sources)
        finally:
            running[0] -= 1

    def counted_delete(self: gcs_bucket.GcsBucket, keys: list[str]) -> None:
        at_delete.append(running[0])
        delete(self, keys)

    monkeypatch.setattr(gcs_bucket.GcsBucket, "compose", slow_compose)
    monkeypatch.setattr(gcs_bucket.GcsBucket, "delete", counted_delete)
    client = ObjectClient(prefix, transfer=SMALL)
    with pytest.raises(StorageError, match=INJECTED):
        upload(client, "f.bin", payload(7.4))
    assert at_delete and max(at_delete) == 0, at_delete  # no compose ran beside a delete
    assert parts_left(client) == []
    assert client.listing() == {}


def big_tree() -> tuple[np.ndarray, dict]:
    w = np.random.default_rng(9).standard_normal((4096, 2560), dtype=np.float32)  # 40 MiB
    return w, {"w": sharded(w, mesh(2, 4), "data", None), "n": 3}


def test_a_save_of_composite_files_restores_bit_exact_and_leaves_no_part(prefix):
    w, tree = big_tree()
    url = f"{prefix}/ckpt"
    snapshard.save(ObjectStorage(url, transfer=SMALL), tree)
    listing = ObjectStorage(url).client.listing()
    assert COMMIT_MARKER in listing and not [n for n in listing if ".part-" in n]
    out = snapshard.load(url)
    assert np.asarray(out["w"]).tobytes() == w.tobytes() and out["n"] == 3


def test_nothing_of_a_save_is_visible_before_its_marker(prefix, monkeypatch):
    """Each data file appears only at its last compose; the checkpoint only at its marker."""
    url = f"{prefix}/ckpt"
    seen: list[tuple[str, bool, bool]] = []
    compose = gcs_bucket.GcsBucket.compose

    def watch(self, key, sources):
        final = ".part-" not in key
        seen.append((key, final, self.bucket.get_blob(key) is not None))
        seen.append((COMMIT_MARKER, final, ObjectRoot(prefix).list().get("ckpt", False)))
        compose(self, key, sources)

    monkeypatch.setattr(gcs_bucket.GcsBucket, "compose", watch)
    _, tree = big_tree()
    snapshard.save(ObjectStorage(url, transfer=SMALL), tree)
    assert any(final for _, final, _ in seen), "the save composed no data file"
    assert not any(visible for _, _, visible in seen), seen
    assert ObjectRoot(prefix).list() == {"ckpt": True}


def test_a_save_whose_part_upload_fails_commits_nothing_and_leaves_nothing(prefix, monkeypatch):
    injector = FaultInjector().install(monkeypatch)
    injector.arm("s3.upload_part", 2)
    url = f"{prefix}/ckpt-{uuid.uuid4().hex[:6]}"
    with pytest.raises(StorageError, match=INJECTED):
        snapshard.save(ObjectStorage(url, transfer=SMALL), big_tree()[1])
    monkeypatch.undo()
    assert ObjectRoot(prefix).list() == {}
    assert ObjectStorage(url).client.listing() == {}


def test_ranged_reads_fill_the_views_in_order_and_a_short_object_is_truncated(prefix):
    client = ObjectClient(prefix, transfer=TransferConfig(read_part_size=1 << 20))
    data = payload(0.5)  # 2.5 MiB: three ranged GETs of at most 1 MiB
    client.put("r.bin", data)
    bufs = [bytearray(100), bytearray(1_500_000), bytearray(len(data) - 1_500_107)]
    client.read_into("r.bin", 7, [memoryview(b) for b in bufs])
    assert b"".join(bufs) == data[7:]
    for offset in (len(data) - 10, len(data) + 5):  # the object ends inside, or before
        with pytest.raises(CorruptCheckpointError, match="is truncated"):
            client.read_into("r.bin", offset, [memoryview(bytearray(100))])


def test_concurrent_ranged_reads_keep_their_connections(prefix, caplog):
    """32 ranged GETs in flight stay within the client's connection pool: none is opened
    for one request and thrown away (urllib3 warns when it discards one)."""
    transfer = TransferConfig(read_part_size=64 << 10, read_concurrency=32)
    client = ObjectClient(prefix, transfer=transfer)
    data = payload(0.8)  # 4 MiB: 64 ranged GETs
    client.put("many.bin", data)
    buf = bytearray(len(data))
    with caplog.at_level("WARNING", logger="urllib3.connectionpool"):
        client.read_into("many.bin", 0, [memoryview(buf)])
    assert buf == data
    assert not [r for r in caplog.records if "pool is full" in r.getMessage()]
