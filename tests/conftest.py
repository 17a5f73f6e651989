"""Test set-up: 8 simulated CPU devices, before JAX is imported anywhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

pytest_plugins = ["s3env"]  # the s3_bucket fixture of the object-store tests


def mesh(*shape: int, names: tuple[str, ...] | None = None) -> Mesh:
    names = names or ("data", "model", "extra")[: len(shape)]
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def sharded(x: np.ndarray, m: Mesh, *spec: object) -> jax.Array:
    return jax.device_put(x, NamedSharding(m, PartitionSpec(*spec)))


@pytest.fixture
def ckpt(tmp_path):
    """A fresh checkpoint path (not yet created)."""
    return tmp_path / "ckpt"
