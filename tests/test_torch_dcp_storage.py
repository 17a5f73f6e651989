"""snapshard.torch.StorageWriter and StorageReader: DCP's own dcp.save, dcp.async_save and
dcp.load on snapshard's format, in one process and across gloo ranks (FSDP2 state)."""

from __future__ import annotations

import io
import json
import os

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import multiproc  # noqa: E402
import snapshard  # noqa: E402
import snapshard.torch as sst  # noqa: E402
from dcp_errors import dcp_failure  # noqa: E402
from snapshard.cli import main as cli  # noqa: E402
from snapshard.errors import CheckpointExistsError, CorruptCheckpointError  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}  # a PyTorch-only install


class Opaque:
    """Not a plain value: DCP pickles it."""

    def __init__(self, n: int) -> None:
        self.n = n


def _state(step: int = 3) -> dict:
    return {
        "model": {"w": torch.arange(24.0).reshape(4, 6), "b": torch.ones(5, dtype=torch.bfloat16)},
        "optim": {
            "state": {"w": {"step": torch.tensor(float(step)), "exp_avg": torch.full((4, 6), 0.5)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w"]}],
        },
        "step": step,
        "name": "run",
        "blob": Opaque(7),
    }


def _target() -> dict:
    return {
        "model": {"w": torch.zeros(4, 6), "b": torch.zeros(5, dtype=torch.bfloat16)},
        "optim": {
            "state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(4, 6)}},
            "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}],
        },
        "step": 0,
        "name": "",
        "blob": None,
    }


@pytest.fixture(autouse=True)
def _quiet_single_process(monkeypatch):
    pytest.importorskip("torch.distributed")
    # DCP warns that it saves in one process when no process group exists: it is meant here.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _same(got: dict, want: dict) -> None:
    for name in ("w", "b"):
        assert torch.equal(got["model"][name], want["model"][name])
    for name in ("step", "exp_avg"):
        assert torch.equal(got["optim"]["state"]["w"][name], want["optim"]["state"]["w"][name])
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert (got["step"], got["name"]) == (want["step"], want["name"])


def test_dcp_save_then_dcp_load(tmp_path):
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=sst.StorageWriter(path))
    target = _target()
    dcp.load(target, storage_reader=sst.StorageReader(path))
    _same(target, _state())
    assert isinstance(target["blob"], Opaque) and target["blob"].n == 7  # DCP's own unpickling


def test_checkpoint_id_names_the_location(tmp_path):
    dcp.save(_state(), checkpoint_id=tmp_path / "ck", storage_writer=sst.StorageWriter())
    target = _target()
    dcp.load(target, checkpoint_id=tmp_path / "ck", storage_reader=sst.StorageReader())
    _same(target, _state())


def test_what_a_dcp_save_stores(tmp_path):
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=sst.StorageWriter(path))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == "2.1"
    assert manifest["extra"]["dcp"]["pickled"] == [
        "optim/param_groups/0/betas",
        "optim/param_groups/0/params",
        "blob",
    ]
    meta = snapshard.metadata(str(path))
    assert meta["step"].value == 3 and meta["name"].value == "run"  # plain values, inline
    assert meta["optim"]["param_groups"][0]["lr"].value == 0.1
    assert meta["blob"].dtype == "uint8"  # opaque bytes: never unpickled by snapshard
    assert cli(["verify", str(path)]) == 0


def test_dcp_save_then_snapshard_load(tmp_path):
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=sst.StorageWriter(path))
    target = {
        "model": {"w": torch.zeros(4, 6)},
        "optim": {"state": _target()["optim"]["state"]},
        "step": 0,
        "name": "",
    }
    sst.load(str(path), target)
    want = _state()
    assert torch.equal(target["model"]["w"], want["model"]["w"])
    assert torch.equal(
        target["optim"]["state"]["w"]["exp_avg"], want["optim"]["state"]["w"]["exp_avg"]
    )
    assert (target["step"], target["name"]) == (3, "run")
    arrays = snapshard.load(str(path))  # NumPy, no target: the pickled entries stay bytes
    assert bytes(arrays["blob"]) == _pickled(want["blob"])


def test_pickled_objects_only_with_trust_pickle(tmp_path):
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=sst.StorageWriter(path))
    with pytest.raises(
        sst.DcpStorageError, match=r"3 leaves hold objects DCP pickled .*trust_pickle"
    ):
        sst.load_pickled(str(path))
    objects = sst.load_pickled(str(path), trust_pickle=True)
    assert objects["optim/param_groups/0/betas"] == (0.9, 0.99)
    assert objects["optim/param_groups/0/params"] == ["w"]
    assert isinstance(objects["blob"], Opaque) and objects["blob"].n == 7
    sst.save(str(tmp_path / "plain"), {"w": torch.ones(2)})
    assert sst.load_pickled(str(tmp_path / "plain")) == {}  # nothing pickled: nothing refused


def _pickled(obj: object) -> bytes:
    out = io.BytesIO()
    torch.save(obj, out)
    return out.getvalue()


def test_snapshard_save_then_dcp_load(tmp_path):
    state = _state()
    del state["blob"]  # snapshard.torch.save takes state, not arbitrary objects
    sst.save(str(tmp_path / "ck"), state)
    target = _target()
    del target["blob"]
    dcp.load(target, storage_reader=sst.StorageReader(tmp_path / "ck"))
    _same(target, state)  # betas and params rebuilt from one leaf per element


def test_async_save_in_a_thread(tmp_path):
    state = _state()
    job = dcp.async_save(state, storage_writer=sst.StorageWriter(tmp_path / "ck"))
    state["model"]["w"].add_(1.0)  # DCP staged a copy before returning
    job.result()
    target = _target()
    dcp.load(target, storage_reader=sst.StorageReader(tmp_path / "ck"))
    _same(target, _state())


def test_an_existing_checkpoint_is_kept(tmp_path):
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=sst.StorageWriter(path))
    kept = sst.StorageWriter(path, overwrite=False)
    again = lambda: dcp.save(_state(step=4), storage_writer=kept)  # noqa: E731
    dcp_failure(again, CheckpointExistsError, "already exists at .*overwrite=True")
    dcp.save(_state(step=5), storage_writer=sst.StorageWriter(path))  # FileSystemWriter's default

    assert snapshard.metadata(str(path))["step"].value == 5


def test_a_corrupted_byte_is_caught_on_load(tmp_path):
    path = tmp_path / "ck"
    dcp.save(_state(), storage_writer=sst.StorageWriter(path))
    data = sorted((path / "data").iterdir())
    raw = bytearray(data[0].read_bytes())
    raw[10] ^= 0x01
    data[0].write_bytes(bytes(raw))
    load = lambda: dcp.load(_target(), storage_reader=sst.StorageReader(path))  # noqa: E731
    dcp_failure(load, CorruptCheckpointError, "checksum")
    assert cli(["verify", str(path)]) != 0


def test_a_failed_save_leaves_nothing(tmp_path, monkeypatch):
    from snapshard.storage import local

    def full(self, name):
        raise OSError(28, "injected: no space left on device")

    monkeypatch.setattr(local.LocalStorage, "open_writer", full)
    path = tmp_path / "ck"
    save = lambda: dcp.save(_state(), storage_writer=sst.StorageWriter(path))  # noqa: E731
    dcp_failure(save, OSError, "no space left")
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # this rank's files removed, staging too


def test_a_failed_commit_leaves_nothing(tmp_path, monkeypatch):
    from snapshard.storage import local

    def refused(self, manifest, *, overwrite):
        raise OSError(5, "injected: commit refused")

    monkeypatch.setattr(local.LocalStorage, "commit", refused)
    path = tmp_path / "ck"
    save = lambda: dcp.save(_state(), storage_writer=sst.StorageWriter(path))  # noqa: E731
    dcp_failure(save, OSError, "commit refused")
    assert not path.exists() and not os.listdir(tmp_path)


def test_compression_and_several_files(tmp_path):
    pytest.importorskip("zstandard")
    path = tmp_path / "ck"
    opts = snapshard.SaveOptions(writers=2, compression="zstd")
    dcp.save(_state(), storage_writer=sst.StorageWriter(path, opts))
    assert len(list((path / "data").iterdir())) == 2
    target = _target()
    dcp.load(target, storage_reader=sst.StorageReader(path))
    _same(target, _state())


def test_memory_store_url(tmp_path):
    pytest.importorskip("obstore")
    url = "memory://bucket/ck"
    writer = sst.StorageWriter(url)
    assert sst.StorageWriter.validate_checkpoint_id(url)
    dcp.save(_state(), storage_writer=writer)
    # memory:// lives in this process's store: the reader finds what the writer committed
    target = _target()
    dcp.load(target, storage_reader=sst.StorageReader(url))
    _same(target, _state())


def test_on_each_object_store(remote_prefix):
    url = f"{remote_prefix}/ck"
    dcp.save(_state(), storage_writer=sst.StorageWriter(url))
    target = _target()
    dcp.load(target, storage_reader=sst.StorageReader(url))
    _same(target, _state())
    tensors = {"model": {"w": torch.zeros(4, 6)}}
    sst.load(url, tensors)
    assert torch.equal(tensors["model"]["w"], _state()["model"]["w"])


def _run(cmd: str, n: int, root) -> list:
    return multiproc.run("torch_dcp_job.py", n, 1, cmd, str(root), timeout=240, env=ENV)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp_state_through_dcp_on_two_ranks_onto_two_and_one(tmp_path):
    saved = _run("save", 2, tmp_path)
    want = saved[0].result()["saved"]
    assert saved[1].result()["saved"] == want
    assert saved[0].result()["after"] != want  # the optimizer stepped after async_save returned
    for name in ("dcp", "async", "sst"):
        assert cli(["verify", str(tmp_path / name)]) == 0
    index = json.loads((tmp_path / "dcp" / "manifest.json").read_text())
    assert index["process_count"] == 2 and len(index["processes"]["data_sizes"]) == 2
    for world in (2, 1):
        for p in _run("load", world, tmp_path):
            got = p.result()
            for name in ("dcp", "async"):
                assert got[name] == want, (world, p.process_id, name)
            no_loader = {k: v for k, v in want.items() if not k.startswith("loader/")}
            assert got["sst"] == no_loader
            tensors = {k: v for k, v in no_loader.items() if not k.startswith("optim/param_groups")}
            assert got["sst.load"] == tensors


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp_state_with_empty_shards_from_four_ranks_onto_two(tmp_path):
    # Over 4 ranks the 5-row tensors shard as 2, 2, 1, 0 rows: a rank writes an empty chunk.
    want = _run("save", 4, tmp_path)[0].result()["saved"]
    assert cli(["verify", str(tmp_path / "dcp")]) == 0
    for p in _run("load", 2, tmp_path):
        assert p.result()["dcp"] == want and p.result()["async"] == want


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.s3
def test_fsdp_state_through_dcp_on_s3_from_two_ranks(request):
    from s3env import fresh_prefix

    root = fresh_prefix(request, "s3")  # each rank writes its objects; rank 0's marker commits
    want = _run("save", 2, root)[0].result()["saved"]
    assert cli(["verify", f"{root}/dcp"]) == 0
    for p in _run("load", 2, root):
        assert p.result()["dcp"] == want and p.result()["async"] == want


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_failed_write_on_one_rank_commits_nothing(tmp_path):
    ranks = _run("fail", 2, tmp_path)
    for p in ranks:
        res = p.result()
        assert res["error"] is not None and "injected: no space left" in res["error"]
        assert not res["committed"]
    assert not (tmp_path / "failed").exists()
    # Every rank learnt of rank 1's failure in write_data and removed what it had staged
    # (DCP calls nothing after a failed write): nothing is left, staging directory included.
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert snapshard.storage.root_for(str(tmp_path)).list().get("failed") in (None, False)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_async_save_in_dcps_checkpointing_process(tmp_path):
    for p in _run("process", 2, tmp_path):
        res = p.result()
        assert res["loaded"] == res["saved"]
    assert cli(["verify", str(tmp_path / "process")]) == 0
