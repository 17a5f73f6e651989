"""A load's object-store client (and its connections) is freed when the load returns, by
reference counting: not left in reference cycles that only the cyclic collector frees
(sockets piled up, one per load, between collections)."""

from __future__ import annotations

import gc
import uuid

import numpy as np

import snapshard
from snapshard.storage.object_client import ObjectClient


def test_a_load_leaves_no_client_behind_for_the_cyclic_collector():
    url = f"memory://leaks-{uuid.uuid4().hex[:8]}/c"
    snapshard.save(url, {"w": np.ones(4, np.float32), "b": {"x": np.arange(3)}})
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            assert snapshard.load(url)["w"].sum() == 4
        alive = sum(isinstance(o, ObjectClient) for o in gc.get_objects())
    finally:
        gc.enable()
    assert alive == 0
