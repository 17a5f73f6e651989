"""Atomic commit, overwrite rules, failing saves, corruption detection and error messages."""

from __future__ import annotations

import json

import numpy as np
import pytest

import snapshard
from snapshard import ReadOptions, SaveOptions
from snapshard.storage import local_files
from snapshard.storage.stale_staging import STAGING_SUFFIX

from conftest import chunk_of


def tree(seed=0):
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((64, 64), dtype=np.float32), "step": seed}


def test_existing_checkpoint_is_refused_without_overwrite(ckpt):
    snapshard.save(ckpt, tree(1))
    with pytest.raises(snapshard.CheckpointExistsError, match=str(ckpt)):
        snapshard.save(ckpt, tree(2))
    assert snapshard.load(ckpt)["step"] == 1


def test_overwrite_replaces_the_checkpoint_whole(ckpt):
    snapshard.save(ckpt, tree(1))
    snapshard.save(ckpt, tree(2), overwrite=True)
    out = snapshard.load(ckpt)
    assert out["step"] == 2 and np.array_equal(out["w"], tree(2)["w"])
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt"]


def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(ckpt):
    ckpt.mkdir()
    (ckpt / "precious.txt").write_text("keep me")
    with pytest.raises(snapshard.CheckpointExistsError, match="not a snapshard checkpoint"):
        snapshard.save(ckpt, tree(1), overwrite=True)
    assert (ckpt / "precious.txt").read_text() == "keep me"


def test_a_save_failing_midway_leaves_nothing_and_damages_nothing(ckpt, tmp_path, monkeypatch):
    older = tmp_path / "older"
    snapshard.save(older, tree(1))
    before = {p.name: p.read_bytes() for p in older.rglob("*") if p.is_file()}
    calls = {"n": 0}
    real_write = local_files.LocalFileWriter.write

    def failing_write(self, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device (injected)")
        real_write(self, data)

    monkeypatch.setattr(local_files.LocalFileWriter, "write", failing_write)
    big = {"a": np.ones((512, 1024), np.float32), "b": np.ones((512, 1024), np.float32)}
    with pytest.raises(OSError, match="injected"):
        snapshard.save(ckpt, big, options=SaveOptions(writers=1))
    monkeypatch.undo()
    assert not ckpt.exists()
    assert not any(p.name.startswith("ckpt") for p in tmp_path.iterdir())
    with pytest.raises(snapshard.CheckpointNotFoundError):
        snapshard.load(ckpt)
    assert {p.name: p.read_bytes() for p in older.rglob("*") if p.is_file()} == before
    # The same location saves fine afterwards.
    snapshard.save(ckpt, tree(3))
    assert snapshard.load(ckpt)["step"] == 3


def test_a_failed_overwrite_keeps_the_old_checkpoint(ckpt, monkeypatch):
    snapshard.save(ckpt, tree(1))

    def boom(self, data):
        raise OSError(5, "I/O error (injected)")

    monkeypatch.setattr(local_files.LocalFileWriter, "write", boom)
    with pytest.raises(OSError, match="injected"):
        snapshard.save(ckpt, tree(2), overwrite=True)
    monkeypatch.undo()
    out = snapshard.load(ckpt)
    assert out["step"] == 1 and np.array_equal(out["w"], tree(1)["w"])


def test_flipped_byte_names_the_leaf(ckpt):
    snapshard.save(ckpt, {"params": {"w": np.arange(4096, dtype=np.float32)}, "other": np.zeros(3)})
    name, offset, _ = chunk_of(ckpt, ("params", "w"))
    path = ckpt / name
    data = bytearray(path.read_bytes())
    data[offset + 100] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(snapshard.ChecksumMismatchError, match=r"leaf 'params/w', chunk 0") as e:
        snapshard.load(ckpt)
    assert name in str(e.value)
    # Without verification the flipped value comes back (and nothing else breaks).
    out = snapshard.load(ckpt, options=ReadOptions(verify=False))
    assert not np.array_equal(out["params"]["w"], np.arange(4096, dtype=np.float32))


def test_truncated_data_file_is_reported(ckpt):
    snapshard.save(ckpt, {"w": np.arange(4096, dtype=np.float32)})
    f = next((ckpt / "data").iterdir())
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(snapshard.CorruptCheckpointError, match="truncated"):
        snapshard.load(ckpt)


def test_missing_and_corrupt_manifests(ckpt, tmp_path):
    with pytest.raises(snapshard.CheckpointNotFoundError, match="does not exist"):
        snapshard.load(tmp_path / "nothing")
    snapshard.save(ckpt, tree(1))
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(snapshard.CorruptCheckpointError, match="not valid JSON"):
        snapshard.load(ckpt)
    (ckpt / "manifest.json").write_text(json.dumps({"format": "snapshard", "version": 99}))
    with pytest.raises(snapshard.CorruptCheckpointError, match="version 99"):
        snapshard.metadata(ckpt)


def test_file_names_from_a_manifest_never_leave_the_checkpoint(ckpt):
    snapshard.save(ckpt, tree(1))
    # v2 derives file names from process numbers and nonces, which must be 8 hex digits.
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    doc["processes"]["nonce"] = "../../.."
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(snapshard.CorruptCheckpointError, match=r"checksum|nonce"):
        snapshard.load(ckpt)


def test_incomplete_save_is_invisible(ckpt):
    # A staging directory left by a crash is not a checkpoint.
    (ckpt.parent / (ckpt.name + STAGING_SUFFIX) / "data").mkdir(parents=True)
    with pytest.raises(snapshard.CheckpointNotFoundError, match="incomplete"):
        snapshard.load(ckpt)
    snapshard.save(ckpt, tree(4))
    assert snapshard.load(ckpt)["step"] == 4
