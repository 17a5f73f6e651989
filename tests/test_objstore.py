"""Object-store storage: the commit-marker protocol, resharding restores, request counts.

Every test runs on memory:// and on each local server (S3, GCS, Azure; marked `s3`, `gcs`,
`azure`, skipped where the server is not configured: see tests/s3env.py). Faults that only a real server path can show are in
test_objstore_faults.py; several processes in test_objstore_multiprocess.py.
"""

from __future__ import annotations

import json
import uuid

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
from s3env import bucket_url, fresh_prefix, store_params
from snapshard.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from snapshard.storage import root_for, storage_for
from snapshard.storage.bucket import TransferConfig
from snapshard.storage.object_writer import PartWriter
from snapshard.storage.objstore import COMMIT_MARKER, ObjectRoot, ObjectStorage

from conftest import mesh, sharded

# Small parts, files of more than one part in parts and a save's data not cut into files
# that fit one request: test-sized files go up as multipart uploads, and reads are split.
SMALL = TransferConfig(
    part_size=5 << 20, single_request_bytes=5 << 20, file_bytes=None,
    read_part_size=1 << 20, max_inflight_bytes=4 << 20,
)  # fmt: skip


@pytest.fixture(params=["memory", *store_params()])
def base(request):
    """A fresh, empty object-store prefix: a memory bucket, or a prefix on a test server."""
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex[:12]}/run"
    return f"{fresh_prefix(request, request.param)}/run"


def storage(url: str) -> ObjectStorage:
    return ObjectStorage(url, transfer=SMALL)


def arrays():
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((1536, 2048), dtype=np.float32),  # 12 MiB: multipart
        "e": rng.standard_normal((256, 512), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal((512,), dtype=np.float32),
    }


def tree_on_2x4(g):
    m = mesh(2, 4)
    return {
        "params": {
            "w": sharded(g["w"], m, "data", "model"),
            "e": sharded(g["e"], m, None, "model"),
            "b": sharded(g["b"], m),
        },
        "host": np.arange(10, dtype=np.int64),
        "step": 17,
    }


def target_on_1x8(g):
    m = mesh(8, names=("x",))

    def sds(a, *spec):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(m, P(*spec)))

    return {
        "params": {"w": sds(g["w"], None, "x"), "e": sds(g["e"], "x"), "b": sds(g["b"])},
        "host": np.zeros(10, np.int64),
        "step": 0,
    }


def bit_exact(x: jax.Array, ref: np.ndarray) -> bool:
    return all(np.asarray(s.data).tobytes() == ref[s.index].tobytes() for s in x.addressable_shards)


def test_save_and_restore_with_resharding_is_bit_exact(base):
    g = arrays()
    st = storage(f"{base}/step_1")
    snapshard.save(st, tree_on_2x4(g))
    saved = st.stats
    assert saved.post >= 2, "12 MiB in 5 MiB parts goes up as multipart uploads"
    assert saved.bytes_sent >= sum(a.nbytes for a in g.values())
    out = snapshard.load(st, target_on_1x8(g))
    for k in ("w", "e", "b"):
        assert bit_exact(out["params"][k], g[k]), k
    assert out["host"].tolist() == list(range(10)) and out["step"] == 17
    # Through the URL alone, into NumPy.
    plain = snapshard.load(f"{base}/step_1")
    assert plain["params"]["e"].tobytes() == g["e"].tobytes()


# A save's data cut into files of at most 2 MiB, each sent in one request.
ONE_REQUEST = TransferConfig(
    single_request_bytes=2 << 20, file_bytes=2 << 20, read_part_size=1 << 20
)


def test_a_save_cuts_its_data_into_files_that_each_go_up_in_one_request(base):
    g = arrays()
    st = ObjectStorage(f"{base}/step_1", transfer=ONE_REQUEST)
    timings = snapshard.save(st, tree_on_2x4(g), snapshard.SaveOptions(writers=2))
    saved = st.stats
    data = {n: size for n, size in st.client.listing().items() if n.startswith("data/")}
    # w's 8 boxes of 1.5 MiB: one a file (two would not fit 2 MiB), e's and b's beside them.
    assert timings.data_files == len(data) == 8
    assert max(data.values()) <= 2 << 20
    # One PUT per data file, then the record file, the manifest and the marker: no
    # multipart upload, no compose, nothing deleted.
    assert (saved.put, saved.post, saved.delete) == (len(data) + 3, 0, 0)
    assert saved.bytes_sent >= sum(a.nbytes for a in g.values())
    out = snapshard.load(st, target_on_1x8(g))
    for k in ("w", "e", "b"):
        assert bit_exact(out["params"][k], g[k]), k


def test_a_file_sent_in_one_request_keeps_what_was_written_not_what_the_buffer_became(base):
    """`write` copies what it holds (the caller may reuse its buffer); `write_kept` holds the
    caller's buffer, which the caller leaves as it is until the file is closed."""
    client = ObjectStorage(f"{base}/w", transfer=ONE_REQUEST).client
    reused, kept = bytearray(b"a" * 1000), np.full(3000, 7, np.uint8)
    writer = PartWriter(client, "f.bin")
    writer.write(memoryview(reused))
    reused[:] = b"b" * 1000
    writer.write(memoryview(reused))
    writer.write_kept(memoryview(kept))
    before = client.stats
    assert writer.close() == 5000
    assert (client.stats - before).put == 1
    assert client.get("f.bin") == b"a" * 1000 + b"b" * 1000 + bytes([7]) * 3000


def test_a_file_that_outgrows_one_request_goes_up_in_parts_from_its_first_byte(base):
    client = ObjectStorage(f"{base}/w", transfer=SMALL).client  # one request: up to 5 MiB
    data = np.random.default_rng(1).integers(0, 256, 12 << 20, dtype=np.uint8)
    writer = PartWriter(client, "f.bin")
    writer.write_kept(memoryview(data[: 3 << 20]))  # held
    writer.write(memoryview(data[3 << 20 : 4 << 20]))  # held, a copy
    writer.write_kept(memoryview(data[4 << 20 :]))  # beyond one request: parts from here
    before = client.stats
    assert writer.close() == data.nbytes
    spent = client.stats - before
    assert spent.post >= 1 and spent.put >= 3  # a multipart (or composite) upload
    assert client.get("f.bin") == data.tobytes()
    aborted = PartWriter(client, "g.bin")
    aborted.write_kept(memoryview(data[: 1 << 20]))
    aborted.abort()
    assert set(client.listing()) == {"f.bin"}


def test_an_item_larger_than_a_cut_file_but_within_one_request_is_one_file_of_one_request(base):
    w = np.random.default_rng(2).standard_normal((1536, 2048), dtype=np.float32)  # 12 MiB
    st = ObjectStorage(
        f"{base}/step_1", transfer=TransferConfig(file_bytes=2 << 20, single_request_bytes=16 << 20)
    )
    timings = snapshard.save(st, {"w": w, "b": np.arange(1000.0)})
    saved = st.stats
    assert timings.data_files == 2  # w alone, b beside it
    assert (saved.put, saved.post, saved.delete) == (2 + 3, 0, 0)
    assert snapshard.load(st)["w"].tobytes() == w.tobytes()


@pytest.mark.parametrize("k", [0, 5])
def test_a_failed_one_request_upload_fails_the_save_and_leaves_nothing(base, monkeypatch, k):
    from faultinject import INJECTED, FaultInjector

    injector = FaultInjector().install(monkeypatch)
    injector.arm("s3.put_file", k)  # a data file, while others are in flight
    st = ObjectStorage(f"{base}/step_1", transfer=ONE_REQUEST)
    with pytest.raises(StorageError, match=rf"upload of 'data/.*' failed.*{INJECTED}"):
        snapshard.save(st, tree_on_2x4(arrays()))
    assert injector.fired is not None
    monkeypatch.undo()
    assert ObjectRoot(base).list() == {}
    assert st.client.listing() == {}


def test_partial_restore_reads_only_the_needed_ranges(base):
    g = arrays()
    st = storage(f"{base}/step_1")
    snapshard.save(st, tree_on_2x4(g))
    manifest_bytes = len(st.read_manifest())
    before = st.stats
    stats = snapshard.ReadStats()
    m = mesh(2, 4)
    target = {
        "params": {"b": jax.ShapeDtypeStruct((512,), np.float32, sharding=NamedSharding(m, P()))}
    }
    out = snapshard.load(st, target, stats=stats)
    assert bit_exact(out["params"]["b"], g["b"])
    used = st.stats - before
    # Only b's 2 KiB (and the manifest) came over the wire, not the 12 MiB of w.
    # Beside the manifest: b's chunk record, its directory entry, and its checksum.
    assert stats.metadata_bytes <= 16 + 40 + 16
    assert used.bytes_received - manifest_bytes - stats.metadata_bytes <= g["b"].nbytes + 4
    assert used.bytes_received - manifest_bytes - stats.metadata_bytes == stats.bytes_read + 4
    assert used.put == used.post == used.delete == 0


def test_a_location_holding_nothing_is_not_found_without_asking_tensorstore(base, monkeypatch):
    """No snapshard manifest and no Orbax metadata: CheckpointNotFoundError at once (TensorStore,
    which waits for credentials of its own, is never asked)."""
    pytest.importorskip("tensorstore")
    from snapshard.orbax import reader as orbax

    def never(location):
        raise AssertionError(f"TensorStore asked about {location}")

    monkeypatch.setattr(orbax, "open_orbax", never)
    with pytest.raises(CheckpointNotFoundError):
        snapshard.load(f"{base}/nothing_here")


def test_only_the_marker_makes_a_checkpoint_exist(base):
    st = storage(f"{base}/step_1")
    assert not st.is_committed()
    with pytest.raises(CheckpointNotFoundError, match="nothing is stored"):
        st.read_manifest()
    snapshard.save(st, {"a": np.arange(100)})
    names = st.client.listing()
    assert COMMIT_MARKER in names and "manifest.json" in names
    assert names[COMMIT_MARKER] == 0
    st.client.delete([COMMIT_MARKER])
    assert not st.is_committed()
    with pytest.raises(CheckpointNotFoundError, match="incomplete save"):
        snapshard.load(st)
    assert ObjectRoot(base).list() == {"step_1": False}


def crash_before_marker(monkeypatch):
    """Make the next save stop like a killed process: manifest written, no marker, no cleanup."""

    def crash(self):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ObjectStorage, "_write_marker", crash)
    monkeypatch.setattr(ObjectStorage, "discard_staging", lambda self: None)


def test_an_unfinished_save_is_never_listed_as_committed_and_is_cleaned(base, monkeypatch):
    g = {"a": np.arange(1000, dtype=np.int32)}
    snapshard.save(storage(f"{base}/step_0"), g)
    with monkeypatch.context() as mp:
        crash_before_marker(mp)
        with pytest.raises(KeyboardInterrupt):
            snapshard.save(storage(f"{base}/step_1"), g)
    root = root_for(base)
    assert isinstance(root, ObjectRoot)
    assert root.list() == {"step_0": True, "step_1": False}
    assert "manifest.json" in root.child("step_1").client.listing()
    with pytest.raises(CheckpointNotFoundError, match="incomplete"):
        snapshard.load(f"{base}/step_1")
    root.remove_incomplete("step_0")  # committed: left alone
    root.remove_incomplete("step_1")
    assert root.list() == {"step_0": True}
    assert root.child("step_1").client.listing() == {}
    assert snapshard.load(f"{base}/step_0")["a"].tolist() == g["a"].tolist()
    # The name is free again.
    snapshard.save(storage(f"{base}/step_1"), g)
    assert root.list() == {"step_0": True, "step_1": True}


def test_delete_removes_the_marker_first(base, monkeypatch):
    st = storage(f"{base}/step_1")
    snapshard.save(st, {"a": np.arange(10)})
    calls = []
    real = type(st.client).delete

    def delete(self, rels):
        calls.append(list(rels))
        if len(calls) == 2:
            raise StorageError("injected: stopped halfway")
        real(self, rels)

    monkeypatch.setattr(type(st.client), "delete", delete)
    with pytest.raises(StorageError):
        st.delete()
    assert calls[0] == [COMMIT_MARKER]
    assert ObjectRoot(base).list() == {"step_1": False}
    monkeypatch.undo()
    st.delete()
    assert st.client.listing() == {}


def test_overwrite_replaces_whole_and_refusal_changes_nothing(base):
    st = storage(f"{base}/step_1")
    snapshard.save(st, {"a": np.arange(1000)})
    before = st.client.listing()
    with pytest.raises(CheckpointExistsError, match=r"overwrite=True"):
        snapshard.save(st, {"a": np.zeros(3)})
    assert st.client.listing() == before
    snapshard.save(st, {"a": np.ones(50)}, overwrite=True)
    assert snapshard.load(st)["a"].tolist() == [1.0] * 50
    after = st.client.listing()
    old_data = {n for n in before if n.startswith(("data/", "index/"))}
    assert not old_data & set(after), "files only the old manifest named are deleted"


def test_a_failed_overwrite_leaves_the_old_checkpoint_intact(base, monkeypatch):
    st = storage(f"{base}/step_1")
    snapshard.save(st, {"a": np.arange(1000)})
    before = st.client.listing()
    real = type(st.client).put

    def put(self, rel, data, *, create=False):
        if rel == "manifest.json":
            raise StorageError("injected: manifest write failed")
        return real(self, rel, data, create=create)

    monkeypatch.setattr(type(st.client), "put", put)
    with pytest.raises(StorageError, match="injected"):
        snapshard.save(st, {"a": np.zeros(1000)}, overwrite=True)
    monkeypatch.undo()
    assert st.client.listing() == before, "the failed save's files are removed, the old ones kept"
    assert snapshard.load(st)["a"].tolist() == list(range(1000))


def test_a_failed_save_leaves_nothing_visible(base, monkeypatch):
    st = storage(f"{base}/step_1")

    def refuse(self):
        raise StorageError(f"{self.url}: access denied to write of 'COMMITTED'")

    monkeypatch.setattr(ObjectStorage, "_write_marker", refuse)
    with pytest.raises(StorageError, match="access denied"):
        snapshard.save(st, {"a": np.arange(100_000)})
    assert ObjectRoot(base).list() == {}
    assert st.client.listing() == {}


def test_memory_stores_are_shared_per_bucket_name():
    a = ObjectStorage("memory://shared-bucket/x")
    snapshard.save(a, {"v": np.arange(3)})
    assert ObjectStorage("memory://shared-bucket/x").is_committed()
    assert not ObjectStorage("memory://other-bucket/x").is_committed()


@pytest.mark.parametrize(
    "url, problem",
    [
        ("s3:///prefix", "names no bucket"),
        ("memory://b/a/../c", r"invalid object key"),
        ("memory://b/a//c", r"invalid object key"),
    ],
)
def test_bad_urls_are_refused_with_the_url(url, problem):
    with pytest.raises(ValueError, match=problem):
        storage_for(url)


def test_gcs_and_azure_urls_select_their_stores():
    from google.auth.credentials import AnonymousCredentials
    from obstore.store import AzureStore

    from snapshard.storage.gcs_bucket import GcsBucket
    from snapshard.storage.obstore_bucket import ObstoreBucket

    gs = ObjectStorage(
        "gs://some-bucket/ckpt", {"credentials": AnonymousCredentials(), "project": "test"}
    )
    assert isinstance(gs.client.api, GcsBucket) and gs.url == "gs://some-bucket/ckpt"
    az = ObjectStorage("az://container/ckpt", {"account_name": "acct", "skip_signature": True})
    assert isinstance(az.client.api, ObstoreBucket) and isinstance(az.client.api.store, AzureStore)
    assert az.client.key("x") == "ckpt/x"


# Options that make each server refuse the request: a wrong key (the GCS emulator checks none).
WRONG_CREDENTIALS = {
    "s3": {"secret_access_key": "wrong"},
    "az": {"access_key": "d3Jvbmcga2V5IG9mIHRoZSByaWdodCBsZW5ndGggZm9yIGF6dXJl"},
}


@pytest.mark.parametrize("scheme", store_params())
def test_missing_bucket_and_bad_credentials_fail_fast_naming_store_bucket_and_key(request, scheme):

    bucket = bucket_url(request, scheme).partition("://")[2]
    missing = f"{scheme}://no-such-bucket-{uuid.uuid4().hex[:8]}/x"
    with pytest.raises(StorageError, match=rf"{missing}: bucket .* does not exist"):
        snapshard.save(missing, {"a": np.arange(3)})
    if scheme in WRONG_CREDENTIALS:
        bad = ObjectStorage(f"{scheme}://{bucket}/x", WRONG_CREDENTIALS[scheme])
        with pytest.raises(StorageError, match=rf"{scheme}://{bucket}/x: access denied") as info:
            snapshard.save(bad, {"a": np.arange(3)})
        assert f"bucket {bucket!r}, key 'x/" in str(info.value) and "set " in str(info.value)
        with pytest.raises(StorageError, match="access denied"):
            ObjectRoot(f"{scheme}://{bucket}", WRONG_CREDENTIALS[scheme]).list()
    assert ObjectRoot(f"{scheme}://{bucket}/{uuid.uuid4().hex}").list() == {}


def test_azure_without_an_account_says_what_to_set(monkeypatch):
    for var in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_USE_EMULATOR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(StorageError) as info:
        ObjectStorage("az://container/ckpt")
    msg = str(info.value)
    assert msg.startswith("az://container: cannot configure the Azure Blob store")
    assert "AZURE_STORAGE_ACCOUNT_NAME" in msg and "AZURE_STORAGE_USE_EMULATOR" in msg


def test_gcs_without_credentials_says_what_to_set(monkeypatch, tmp_path):
    for var in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud login
    monkeypatch.setenv("NO_GCE_CHECK", "True")  # not on GCP: don't wait for its metadata server
    with pytest.raises(StorageError) as info:
        ObjectStorage("gs://some-bucket/ckpt")
    msg = str(info.value)
    assert msg.startswith("gs://some-bucket: no Google credentials found")
    assert "GOOGLE_APPLICATION_CREDENTIALS" in msg and "STORAGE_EMULATOR_HOST" in msg


def test_checkpoint_manager_on_an_object_store(base, monkeypatch):
    """The manager's start-up cleanup and retention go through ObjectRoot unchanged."""
    from snapshard import CheckpointManager
    from snapshard.manager import LeasePolicy, ManagerPolicies

    with CheckpointManager(base, max_to_keep=2) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"x": np.full(1000, step, np.int32)}, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
    with monkeypatch.context() as mp:
        crash_before_marker(mp)
        with pytest.raises(KeyboardInterrupt):
            snapshard.save(storage(f"{base}/4"), {"x": np.zeros(1000, np.int32)})
    assert ObjectRoot(base).list() == {"2": True, "3": True, "4": False}
    eager = ManagerPolicies(lease=LeasePolicy(at_start=True))  # a writer's clean-up when made
    with CheckpointManager(base, max_to_keep=2, policies=eager) as mgr:
        assert ObjectRoot(base).list() == {"2": True, "3": True}
        assert mgr.latest_step() == 3
        assert mgr.restore()["x"].tolist() == [3] * 1000


def test_the_command_line_on_an_object_store(base, capsys):
    from snapshard.cli import main

    snapshard.save(f"{base}/1", {"w": np.arange(1000.0), "n": 3})
    snapshard.save(f"{base}/2", {"w": np.arange(1000.0) + 1, "n": 3})

    def run(*argv: str) -> tuple[int, str]:
        code = main(list(argv))
        return code, capsys.readouterr().out

    code, listing = run("ls", base)
    assert code == 0 and [line.split()[:2] for line in listing.splitlines()[1:]] == [
        ["1", "complete"],
        ["2", "complete"],
    ]
    code, info = run("info", f"{base}/1")
    assert code == 0 and "w" in info and "1000" in info
    assert run("verify", f"{base}/1")[0] == 0
    code, diff = run("diff", f"{base}/1", f"{base}/2", "--values", "--json")
    assert code == 1 and [v["name"] for v in json.loads(diff)["values"]] == ["w"]
    assert run("convert", f"{base}/1", f"{base}/3")[0] == 0
    assert snapshard.load(f"{base}/3")["w"].tolist() == list(np.arange(1000.0))


def test_safetensors_load_from_an_object_store_reads_only_the_needed_ranges(base, tmp_path):
    from safetensors.numpy import save_file

    import snapshard.safetensors as sst

    rng = np.random.default_rng(3)
    tensors = {"w": rng.standard_normal((512, 1024), dtype=np.float32), "b": np.arange(64.0)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    up = ObjectStorage(base)
    up.client.put("model.safetensors", (tmp_path / "model.safetensors").read_bytes())
    stats = snapshard.ReadStats()
    out = sst.load(f"{base}/model.safetensors", {"b": np.zeros(64)}, stats=stats)
    assert out["b"].tobytes() == tensors["b"].tobytes()
    assert stats.bytes_read <= tensors["b"].nbytes, "only b's bytes, not the 2 MiB of w"
    m = mesh(2, 4)
    w = jax.ShapeDtypeStruct((512, 1024), np.float32, sharding=NamedSharding(m, P("data", "model")))
    assert bit_exact(sst.load(f"{base}/model.safetensors", {"w": w})["w"], tensors["w"])


@pytest.mark.parametrize("scheme", [p for p in store_params() if p.values[0] in ("s3", "gs")])
def test_an_orbax_checkpoint_on_an_object_store_is_read(request, scheme, tmp_path):
    """Orbax checkpoints are read through TensorStore's own drivers (s3 and gcs)."""
    pytest.importorskip("orbax.checkpoint")
    from orbax_writer import save_pytree, state_tree

    tree = state_tree()
    local = save_pytree(tmp_path / "orbax", tree, "ocdbt-zarr")
    url = f"{fresh_prefix(request, scheme)}/orbax"
    up = ObjectStorage(url)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        up.client.put(path.relative_to(local).as_posix(), path.read_bytes())
    out = snapshard.load(url)
    for k in ("w", "emb", "odd", "bias"):
        assert out["params"][k].tobytes() == np.asarray(tree["params"][k]).tobytes(), k
    assert out["step"] == 1000 and out["name"] == "run-7"


def failing_part_upload(scheme: str):
    """(upload class, an error of the store's own library) for a part upload that fails."""
    if scheme == "gs":
        from google.api_core.exceptions import ServiceUnavailable

        from snapshard.storage.gcs_bucket import GcsUpload

        return GcsUpload, ServiceUnavailable("injected: part upload failed")
    from obstore.exceptions import GenericError

    from snapshard.storage.obstore_bucket import ObstoreUpload

    return ObstoreUpload, GenericError("injected: part upload failed")


@pytest.mark.parametrize("scheme", store_params())
def test_a_failed_part_upload_is_a_storage_error_and_leaves_nothing(request, scheme, monkeypatch):
    url = f"{fresh_prefix(request, scheme)}/run/step_1"
    upload, error = failing_part_upload(scheme)

    def write(self, part):
        raise error

    monkeypatch.setattr(upload, "write", write)
    with pytest.raises(StorageError, match=rf"{url}: upload of 'data/.*injected") as info:
        snapshard.save(storage(url), arrays())
    assert "bucket" in str(info.value) and "key '" in str(info.value)
    monkeypatch.undo()
    assert ObjectRoot(url.rsplit("/", 1)[0]).list() == {}
    assert storage(url).client.listing() == {}
