"""`dcp.load` of a corrupt checkpoint through snapshard.torch.StorageReader, on two gloo
ranks: every rank raises, and what it raises names the data file and the leaf.

DCP gathers each rank's exception with pickle (all_gather_object) and raises its own
CheckpointException on every rank, whose text holds the failing ranks' errors: the errors
must survive that trip (snapshard.errors) and say where the damage is."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("torch.distributed.checkpoint")

import multiproc

from conftest import chunk_of

pytestmark = pytest.mark.multiprocess
ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}


def _run(cmd: str, *roots) -> list[list[dict]]:
    """Each rank's results (one per root, in order)."""
    procs = multiproc.run("dcp_corrupt.py", 2, 1, cmd, *map(str, roots), timeout=120, env=ENV)
    return [p.results for p in procs]


def _flip_a_byte(root) -> tuple[str, str]:
    # rank 1's half of model.w: the second chunk in box order
    file, offset, nbytes = chunk_of(root, ("model", "w"), 1)
    with open(root / file, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return file, "checksum mismatch"


def _truncate_a_data_file(root) -> tuple[str, str]:
    file, offset, nbytes = chunk_of(root, ("model", "w"), 1)
    os.truncate(root / file, offset + nbytes // 2)
    return file, "is truncated"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """One checkpoint saved by the ranks; a copy of it damaged each way; then one job that
    loads the copies in turn: {damage: (the damaged file, what the error must say, each
    rank's result)}."""
    base = tmp_path_factory.mktemp("dcp_corrupt")
    _run("save", base / "ckpt")
    assert (base / "ckpt" / "manifest.json").is_file()
    cases = {}
    for damage in (_flip_a_byte, _truncate_a_data_file):
        root = base / damage.__name__
        shutil.copytree(base / "ckpt", root)
        cases[damage.__name__] = (root, *damage(root))
    ranks = _run("load", *(root for root, _, _ in cases.values()))
    return {
        name: (file, says, [{r["root"]: r for r in got}.get(str(root)) for got in ranks])
        for name, (root, file, says) in cases.items()
    }


def _assert_every_rank_names(results: list[dict], file: str, leaf: str) -> None:
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["error"] == "CheckpointException", r
        assert file in r["text"], r["text"]
        assert leaf in r["text"], r["text"]
        assert "TypeError" not in r["text"], r["text"]  # an error that failed to unpickle


def test_a_flipped_byte_fails_every_rank_naming_file_and_leaf(loaded):
    file, says, results = loaded["_flip_a_byte"]
    _assert_every_rank_names(results, file, "model/w")
    assert all(says in r["text"] for r in results)


def test_a_truncated_data_file_fails_every_rank_naming_file_and_leaf(loaded):
    file, says, results = loaded["_truncate_a_data_file"]
    assert all(says in r["text"] for r in results), results
    _assert_every_rank_names(results, file, "model/w")
