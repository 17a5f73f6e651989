"""A local-tier copy that fails verification is skipped for the next copy, never retried."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

import snapshard
from snapshard.manager import LocalTier

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
