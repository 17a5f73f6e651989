"""A local-tier copy that fails verification is skipped for the next copy, never retried;
local copies are built into the target by the restore builder."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import snapshard
from snapshard.jax.local_copies import box_key, build_from_local
from snapshard.manager import LocalTier
from snapshard.planning.layout import slices_to_box

from conftest import mesh, sharded

pytestmark = pytest.mark.timeout(120)


def state(step, m):
    return {"w": sharded(np.full((8, 4), step, np.float32), m, "data"), "step": step}


def target(m):
    s = state(0, m)
    return {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=s["w"].sharding), "step": 0}


def test_a_corrupt_local_copy_falls_back_to_the_persistent_tier(tmp_path, caplog):
    m8 = mesh(8)
    tier = LocalTier(str(tmp_path / "local"), interval=1, max_to_keep=2)
    with snapshard.CheckpointManager(tmp_path / "p", save_interval_steps=2, local_tier=tier) as m:
        for step in (1, 2, 3):
            m.save(step, state(step, m8))
        m.wait_until_finished()
        out = m.restore(target=target(m8))
        assert out["step"] == 3 and m.last_restore is not None
        assert m.last_restore.tier == "local"
        # Flip one byte of the newest local copy's data.
        own = tmp_path / "local" / "process-00000" / "3" / "own" / "data"
        f = sorted(own.iterdir())[0]
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
        with caplog.at_level(logging.WARNING, "snapshard"):
            out = m.restore(target=target(m8))
        assert out["step"] == 2 and np.all(np.asarray(out["w"]) == 2)
        r = m.last_restore
        assert r.tier == "persistent" and r.step == 2
        assert any("step 3" in s and "checksum" in s for s in r.skipped)
        assert "failed verification" in caplog.text
        assert not (tmp_path / "local" / "process-00000" / "3" / "own").exists()
        assert set(m.tier_reports()[3].as_dict()) >= {"blocking_s", "local_bytes"}


def test_local_entries_are_built_by_the_restore_builder():
    """Device shards, typed keys and host arrays come back as `load` builds them: onto the
    target's sharding and dtype, a host array onto a sharding too."""
    m = mesh(2, 2)
    w = np.arange(32, dtype=np.float32).reshape(8, 4)
    target = sharded(np.zeros((8, 4), np.float16), m, "data", "model")
    shards = {
        box_key(slices_to_box(s.index, (8, 4))): w[s.index] for s in target.addressable_shards
    }
    out = build_from_local({"shards": shards}, target, ("w",), "here")
    assert out.sharding == target.sharding and out.dtype == np.float16
    assert np.array_equal(np.asarray(out), w.astype(np.float16))

    keys = jax.random.split(jax.random.key(7), 4)
    data = np.asarray(jax.random.key_data(keys))
    kt = jax.device_put(keys, NamedSharding(m, PartitionSpec("data")))
    kshards = {
        box_key(slices_to_box((*s.index[:1], slice(None)), data.shape)): data[s.index[:1]]
        for s in kt.addressable_shards
    }
    impl = str(jax.random.key_impl(keys))
    got = build_from_local({"shards": kshards, "key_impl": impl}, kt, ("k",), "here")
    assert got.sharding == kt.sharding
    assert np.array_equal(np.asarray(jax.random.key_data(got)), data)

    host = np.arange(6, dtype=np.int64)
    onto = sharded(np.zeros(6, np.int64), m, "data")
    placed = build_from_local({"value": host}, onto, ("h",), "here")
    assert placed.sharding == onto.sharding and np.array_equal(np.asarray(placed), host)
    assert (
        build_from_local({"value": host}, np.zeros(6, np.float32), ("h",), "here").dtype
        == np.float32
    )
    assert build_from_local({"value": 5}, 0, ("n",), "here") == 5
