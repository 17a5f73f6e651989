"""A saved state is freed by reference counting once the caller drops it: nothing of a save
keeps it in a reference cycle, which the saves' collection pauses (gc_pause.py) could leave
uncollected for as long as the program runs (every save's state kept: memory that grows
with each save)."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

import snapshard


@pytest.fixture
def no_collector():
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _state():
    host = np.arange(1024.0)
    device = jnp.arange(256.0)
    return {"params": {"w": host, "d": device}, "opt": [host + 1, (device * 2,)], "step": 3}


@pytest.mark.parametrize("how", ["save", "save_async", "manager"])
def test_a_saved_state_dies_with_its_last_reference(tmp_path, no_collector, how):
    state = _state()
    watched = [weakref.ref(state["params"]["w"]), weakref.ref(state["params"]["d"])]
    if how == "save":
        snapshard.save(tmp_path / "c", state)
    elif how == "save_async":
        snapshard.save_async(tmp_path / "c", state).wait()
    else:
        with snapshard.CheckpointManager(tmp_path / "run", max_to_keep=1) as m:
            for step in range(3):
                m.save(step, state)
            m.wait_until_finished()
    del state
    assert [w() is None for w in watched] == [True, True]
    assert (
        snapshard.load(tmp_path / "c" if how != "manager" else tmp_path / "run" / "2")["step"] == 3
    )
