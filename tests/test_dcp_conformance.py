"""DCP's storage scenarios through snapshard.torch.StorageWriter/StorageReader: what
PyTorch's own DCP tests (test_file_system_checkpoint*.py, e2e/test_e2e_save_and_load.py,
test_dtensor_resharding.py, test_dtensor_checkpoint.py) ask of FileSystemWriter/Reader,
asked here of snapshard's storage, written the way those tests and users write it: into
existing empty directories, by `checkpoint_id`, async on both executors, resharded across
placements and world sizes, nested state with plain tensors and pickled objects,
`storage_meta`, `validate_checkpoint_id`, one writer or reader for several checkpoints,
two saves to one path."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import multiproc  # noqa: E402
import snapshard  # noqa: E402
import snapshard.torch as sst  # noqa: E402
from snapshard.cli import main as cli  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}  # a PyTorch-only install


@pytest.fixture(autouse=True)
def _single_process_dcp():
    # DCP warns that it saves in one process when no process group exists: it is meant here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


class Counter:
    """A Stateful object (DCP calls state_dict / load_state_dict on it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n, "history": [self.n - 1, self.n]}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        assert sd["history"] == [self.n - 1, self.n]


class Opaque:
    """Not state of torch's: DCP pickles it (a BYTE_IO item)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag


def _module_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 5), torch.nn.EmbeddingBag(5, 10))
    return dict(model.state_dict())


def _state(seed: int) -> dict:
    return {
        "model": _module_state(seed),
        "nested": {"a": {"b": [torch.full((2, 2), float(seed)), {"c": torch.arange(3) + seed}]}},
        "bf16": torch.ones(4, dtype=torch.bfloat16) * seed,
        "counter": Counter(seed),
        "bytes0": [seed],
        "bytes1": f"string-{seed}",
        "blob": Opaque(f"tag-{seed}"),
        "raw": b"\x00\x01" * seed,
    }


def _empty_like(state: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "nested": {"a": {"b": [torch.zeros(2, 2), {"c": torch.zeros(3, dtype=torch.int64)}]}},
        "bf16": torch.zeros(4, dtype=torch.bfloat16),
        "counter": Counter(0),
        "bytes0": [],
        "bytes1": "",
        "blob": None,
        "raw": b"",
    }


def _assert_same(got: dict, want: dict) -> None:
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    (g0, g1), (w0, w1) = got["nested"]["a"]["b"], want["nested"]["a"]["b"]
    assert torch.equal(g0, w0) and torch.equal(g1["c"], w1["c"])
    assert torch.equal(got["bf16"], want["bf16"]) and got["bf16"].dtype == torch.bfloat16
    assert got["counter"].n == want["counter"].n
    assert (got["bytes0"], got["bytes1"], got["raw"]) == (
        want["bytes0"], want["bytes1"], want["raw"],
    )  # fmt: skip
    assert isinstance(got["blob"], Opaque) and got["blob"].tag == want["blob"].tag


def _roundtrip(save, load, seed: int = 1) -> None:
    want = _state(seed)
    save(want)
    got = _empty_like(want)
    load(got)
    _assert_same(got, want)


def test_into_an_existing_empty_directory_as_dcps_tests_make_it(tmp_path):
    path = tempfile.mkdtemp(dir=tmp_path)  # DCP's tests and tutorials mkdtemp the path
    _roundtrip(
        lambda s: dcp.save(s, storage_writer=sst.StorageWriter(path)),
        lambda t: dcp.load(t, storage_reader=sst.StorageReader(path)),
    )
    assert cli(["verify", path]) == 0
    with tempfile.TemporaryDirectory(dir=tmp_path) as scoped:  # and TemporaryDirectory
        _roundtrip(
            lambda s: dcp.save(s, checkpoint_id=scoped, storage_writer=sst.StorageWriter()),
            lambda t: dcp.load(t, checkpoint_id=scoped, storage_reader=sst.StorageReader()),
        )


@pytest.mark.parametrize("kind", [str, Path])
def test_checkpoint_id_paths(tmp_path, kind):
    path = kind(tmp_path / "run" / "step_1")  # parents are made as FileSystemWriter makes them
    _roundtrip(
        lambda s: dcp.save(s, checkpoint_id=path, storage_writer=sst.StorageWriter()),
        lambda t: dcp.load(t, checkpoint_id=path, storage_reader=sst.StorageReader()),
    )
    # checkpoint_id names the location even where the writer was made with another one
    other = tmp_path / "other"
    _roundtrip(
        lambda s: dcp.save(s, checkpoint_id=other, storage_writer=sst.StorageWriter(path)),
        lambda t: dcp.load(t, checkpoint_id=other, storage_reader=sst.StorageReader(path)),
        seed=2,
    )
    assert snapshard.storage.storage_for(str(other)).is_committed()


def test_one_writer_and_one_reader_for_several_checkpoints(tmp_path):
    writer, reader = sst.StorageWriter(), sst.StorageReader()
    for seed in (1, 2, 3):
        dcp.save(_state(seed), checkpoint_id=tmp_path / f"s{seed}", storage_writer=writer)
    for seed in (3, 1, 2):
        got = _empty_like(_state(seed))
        dcp.load(got, checkpoint_id=tmp_path / f"s{seed}", storage_reader=reader)
        _assert_same(got, _state(seed))


def test_saving_twice_to_one_path_replaces_the_first(tmp_path):
    path = tmp_path / "ck"
    writer = sst.StorageWriter(path)
    dcp.save(_state(1), storage_writer=writer)
    dcp.save(_state(2), storage_writer=writer)  # the same instance, the same path
    dcp.save(_state(3), storage_writer=sst.StorageWriter(path))  # a new one, likewise
    got = _empty_like(_state(3))
    dcp.load(got, storage_reader=sst.StorageReader(path))
    _assert_same(got, _state(3))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no staging or old copy left


def test_filesystem_writer_keywords_are_taken(tmp_path):
    from torch.distributed.checkpoint._extension import ZStandard

    path = tmp_path / "ck"
    writer = sst.StorageWriter(
        path=path, thread_count=2, single_file_per_rank=True, sync_files=True,
        per_thread_copy_ahead=1 << 20, cache_staged_state_dict=False, _extensions=[ZStandard()],
    )  # fmt: skip
    assert writer.options.writers == 2 and writer.options.compression == "zstd"
    _roundtrip(
        lambda s: dcp.save(s, storage_writer=writer),
        lambda t: dcp.load(t, storage_reader=sst.StorageReader(path)),
    )
    assert len(os.listdir(path / "data")) == 2  # thread_count: the files this rank writes

    class Rot13:
        @staticmethod
        def registry_name() -> str:
            return "stream.rot13"

    with pytest.raises(ValueError, match=r"cannot apply DCP's stream extension 'stream\.rot13'"):
        sst.StorageWriter(path, _extensions=[Rot13()])
    with pytest.raises(TypeError, match="unexpected keyword"):
        sst.StorageWriter(path, thread_cont=2)


def test_async_save_on_the_thread_executor_in_one_process(tmp_path):
    live = _state(4)
    job = dcp.async_save(live, storage_writer=sst.StorageWriter(tmp_path / "ck"))
    live["bf16"].add_(100)  # DCP staged a copy before returning
    job.result()
    got = _empty_like(live)
    dcp.load(got, storage_reader=sst.StorageReader(tmp_path / "ck"))
    _assert_same(got, _state(4))


def test_storage_meta(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner

    seen = []

    class Recording(DefaultSavePlanner):
        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            seen.append(storage_meta)
            super().set_up_planner(state_dict, storage_meta, is_coordinator)

    writer = sst.StorageWriter()
    for name in ("a", "b"):
        dcp.save(
            _state(1), checkpoint_id=tmp_path / name, storage_writer=writer, planner=Recording()
        )
    assert [str(m.checkpoint_id) for m in seen] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert all(m.save_id for m in seen) and seen[0].save_id != seen[1].save_id
    meta = sst.StorageReader(tmp_path / "a").read_metadata()
    assert str(meta.storage_meta.checkpoint_id) == str(tmp_path / "a")
    assert set(meta.state_dict_metadata) >= {"model.0.weight", "bytes1", "blob"}


def test_validate_checkpoint_id(tmp_path):
    committed, empty = tmp_path / "ck", tmp_path / "empty"
    dcp.save(_state(1), storage_writer=sst.StorageWriter(committed))
    empty.mkdir()
    for where in (committed, str(committed), empty, tmp_path / "not-yet"):
        assert sst.StorageWriter.validate_checkpoint_id(where)  # any place one can write
    assert sst.StorageReader.validate_checkpoint_id(committed)
    assert sst.StorageReader.validate_checkpoint_id(str(committed))
    for nothing in (empty, tmp_path / "not-yet"):
        assert not sst.StorageReader.validate_checkpoint_id(nothing)  # nothing to read
    for bad in ("", "ftp://host/ck"):
        assert not sst.StorageWriter.validate_checkpoint_id(bad)
        assert not sst.StorageReader.validate_checkpoint_id(bad)


@pytest.mark.multiprocess
def test_two_ranks_save_every_way_then_load_onto_other_placements_and_one_rank(tmp_path):
    os.mkdir(tmp_path / "empty")  # as DCP's tests: mkdtemp on rank 0, broadcast
    run = lambda cmd, n: multiproc.run(  # noqa: E731
        "dcp_conformance.py", n, 1, cmd, str(tmp_path), timeout=240, env=ENV
    )
    ranks = run("save", 2)
    saved = ranks[0].result()["saved"]
    assert saved["twice"]["step"] == 8 and saved["empty"]["repl"][0][0] == 201.0
    for p in ranks:
        got = p.result()
        assert got["saved"] == saved
        for name, want in saved.items():  # resharded: Shard(0) -> Replicate, Shard(1) ->
            assert got["loaded"][name] == want, (p.process_id, name)  # Shard(0), ...
        meta = got["storage_meta"]  # ckid, reuse-1, reuse-2: the checkpoint_id of each save
        assert [m[0] for m in meta] == [str(tmp_path / n) for n in ("ckid", "reuse-1", "reuse-2")]
        assert len({m[1] for m in meta}) == 3  # a save_id per save
    alone = run("load", 1)[0].result()["loaded"]
    for name, want in saved.items():
        got = dict(alone[name])
        assert got.pop("shard0 on one device") == want["shard0"], name
        assert got == want, name
    for name in saved:
        assert cli(["verify", str(tmp_path / name)]) == 0, name
    assert sorted(os.listdir(tmp_path)) == sorted(saved)  # no staging directory left


def test_dcp_over_less_than_the_whole_job(tmp_path):
    """3 ranks: `no_dist=True` on rank 0 alone, and a process group of ranks 1 and 2, save
    without waiting for the ranks outside them (they waited until their timeout), and the
    pair's read-once load fills both targets (its readers were numbered by job rank: the
    pair's second rank read nothing and was sent nothing, its target left zeros)."""
    results = [
        p.result() for p in multiproc.run("dcp_groups.py", 3, 1, tmp_path, timeout=240, env=ENV)
    ]
    assert results[0]["alone"] == [7.0] * 4
    n = 1 << 19
    for r in results[1:]:
        assert r["pair"] == [float(n * (n - 1) // 2), [0.0, 1.0, 2.0]], r
    # the pair's checkpoint holds rank 1's value (the pair's first rank), as DCP's keeps
    assert sst.load(tmp_path / "pair")["w"].tolist() == [1.0] * 4
