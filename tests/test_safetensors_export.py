"""Export of sharded arrays as safetensors: read back by the safetensors library, atomically."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import load_file

import snapshard
import snapshard.safetensors as sst
from snapshard.safetensors import export, writing

from conftest import mesh


def tree():
    rng = np.random.default_rng(7)
    m = mesh(2, 4)
    host = {
        "w": rng.standard_normal((64, 48)).astype(np.float32),
        "cols": rng.standard_normal((8, 32)).astype(np.float32),
        "bf": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "rep": np.arange(10, dtype=np.int32),
        "host": np.arange(6, dtype=np.uint8).reshape(2, 3),
    }
    specs = {"w": P("data", "model"), "cols": P(None, "model"), "bf": P("model"), "rep": P()}
    arrays = {
        k: jax.device_put(v, NamedSharding(m, specs[k])) for k, v in host.items() if k in specs
    }
    return {"layer": {**arrays, "host": host["host"]}}, {f"layer.{k}": v for k, v in host.items()}


def test_export_loads_bit_exact_with_the_safetensors_library(tmp_path):
    t, ref = tree()
    out = sst.save(tmp_path / "model.safetensors", t, metadata={"format": "pt"})
    assert out.files == ["model.safetensors"]
    assert out.bytes_written == sum(v.nbytes for v in ref.values())  # replicas written once
    loaded = load_file(tmp_path / "model.safetensors")
    for k, v in ref.items():
        if k != "layer.bf":
            assert loaded[k].dtype == v.dtype and loaded[k].tobytes() == v.tobytes(), k
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        bf = f.get_tensor("layer.bf")
    assert (
        bf.dtype == torch.bfloat16
        and bf.view(torch.int16).numpy().tobytes() == ref["layer.bf"].tobytes()
    )
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_large_exports_are_split_with_an_index_and_load_back(tmp_path):
    t, ref = tree()
    out = sst.save(tmp_path / "ckpt", t, max_file_bytes=8 << 10)
    assert len(out.files) > 1
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(ref)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in ref.values())
    merged = {}
    for f in out.files:
        merged.update(load_file(tmp_path / "ckpt" / f))
    assert {k: v.tobytes() for k, v in merged.items()} == {k: v.tobytes() for k, v in ref.items()}
    back = sst.load(tmp_path / "ckpt")
    assert {k: v.tobytes() for k, v in back.items()} == {k: v.tobytes() for k, v in ref.items()}


def test_an_existing_file_is_refused_then_replaced_whole(tmp_path):
    t, ref = tree()
    p = tmp_path / "m.safetensors"
    p.write_bytes(b"precious")
    with pytest.raises(snapshard.CheckpointExistsError, match="overwrite=True"):
        sst.save(p, t)
    assert p.read_bytes() == b"precious"
    sst.save(p, t, overwrite=True)
    assert load_file(p)["layer.w"].tobytes() == ref["layer.w"].tobytes()


def test_a_failing_export_leaves_the_existing_file_untouched(tmp_path, monkeypatch):
    t, _ = tree()
    p = tmp_path / "m.safetensors"
    p.write_bytes(b"precious")
    calls = {"n": 0}
    real = writing.pwrite_all

    def failing(fd, data, offset):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device (injected)")
        real(fd, data, offset)

    monkeypatch.setattr(writing, "pwrite_all", failing)
    with pytest.raises(OSError, match="injected"):
        sst.save(p, t, overwrite=True)
    assert p.read_bytes() == b"precious"
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]


def test_export_takes_save_options_and_the_former_keywords_with_a_warning(tmp_path, monkeypatch):
    t, ref = tree()
    budgets = []
    real = export._write_own

    def write_own(target, files, pid, plan, budget):
        budgets.append((plan.mode, budget))
        return real(target, files, pid, plan, budget)

    monkeypatch.setattr(export, "_write_own", write_own)
    options = snapshard.SaveOptions(mode="single_replica", host_budget=1 << 10, timeout_s=30)
    sst.save(tmp_path / "a.safetensors", t, options)
    assert budgets == [("single_replica", 1 << 10)]
    sst.save(tmp_path / "b.safetensors", t, snapshard.SaveOptions(host_budget=0))
    assert budgets[-1][1] == 0
    sst.save(tmp_path / "c.safetensors", t)
    assert budgets[-1][1] == snapshard.SaveOptions().host_budget  # the same default
    for name in "abc":
        loaded = load_file(tmp_path / f"{name}.safetensors")
        assert loaded["layer.w"].tobytes() == ref["layer.w"].tobytes()
    with pytest.raises(ValueError, match=r"compression and hashes .* do not apply"):
        sst.save(tmp_path / "d.safetensors", t, snapshard.SaveOptions(compression="zstd"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'writers'"):
        sst.save(tmp_path / "d.safetensors", t, writers=2)
    with pytest.raises(TypeError, match=r"must be a snapshard\.SaveOptions"):
        sst.save(tmp_path / "d.safetensors", t, {"mode": "auto"})
    assert not (tmp_path / "d.safetensors").exists()


def test_unsupported_leaves_are_named(tmp_path):
    with pytest.raises(snapshard.UnsupportedLeafError, match=r"'a/b'.*arrays only"):
        sst.save(tmp_path / "x.safetensors", {"a": {"b": 3}})
    with pytest.raises(snapshard.UnsupportedLeafError, match="int4 has no safetensors equivalent"):
        sst.save(tmp_path / "x.safetensors", {"q": np.zeros(4, ml_dtypes.int4)})
    with pytest.raises(snapshard.StorageError, match="needs a filesystem"):
        sst.save("s3://bucket/model.safetensors", {"q": np.zeros(4, np.float32)})
    assert not os.listdir(tmp_path)
