"""`dcp.load` of a corrupt checkpoint through snapshard.torch.StorageReader, on two gloo
ranks: every rank raises, and what it raises names the data file and the leaf.

DCP gathers each rank's exception with pickle (all_gather_object) and raises its own
CheckpointException on every rank, whose text holds the failing ranks' errors: the errors
must survive that trip (snapshard.errors) and say where the damage is."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch.distributed.checkpoint")

import multiproc

from conftest import chunk_of

pytestmark = pytest.mark.multiprocess
ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}


def _run(cmd: str, root) -> list[dict]:
    procs = multiproc.run("dcp_corrupt.py", 2, 1, cmd, str(root), timeout=120, env=ENV)
    return [p.result() for p in procs]


@pytest.fixture
def saved(tmp_path):
    root = tmp_path / "ckpt"
    _run("save", root)
    assert (root / "manifest.json").is_file()
    return root


def _assert_every_rank_names(results: list[dict], file: str, leaf: str) -> None:
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["error"] == "CheckpointException", r
        assert file in r["text"], r["text"]
        assert leaf in r["text"], r["text"]
        assert "TypeError" not in r["text"], r["text"]  # an error that failed to unpickle


def test_a_flipped_byte_fails_every_rank_naming_file_and_leaf(saved):
    # rank 1's half of model.w: the second chunk in box order
    file, offset, nbytes = chunk_of(saved, ("model", "w"), 1)
    with open(saved / file, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    results = _run("load", saved)
    _assert_every_rank_names(results, file, "model/w")
    assert all("checksum mismatch" in r["text"] for r in results)


def test_a_truncated_data_file_fails_every_rank_naming_file_and_leaf(saved):
    file, offset, nbytes = chunk_of(saved, ("model", "w"), 1)
    os.truncate(saved / file, offset + nbytes // 2)
    results = _run("load", saved)
    assert all("is truncated" in r["text"] for r in results), results
    _assert_every_rank_names(results, file, "model/w")
