"""Test set-up: 8 simulated CPU devices, before JAX is imported anywhere."""

import os
import threading
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest
from hypothesis import settings
from jax.sharding import Mesh, NamedSharding, PartitionSpec

pytest_plugins = ["s3env"]  # the s3_bucket fixture of the object-store tests

# CI draws the same examples every run (a red CI then means a change broke something, not
# that a new example was drawn); local runs draw new ones, and what fails there is pinned
# with @example. The profile is chosen by SNAPSHARD_HYPOTHESIS_PROFILE (.ci/run: "ci").
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.load_profile(os.environ.get("SNAPSHARD_HYPOTHESIS_PROFILE", "default"))


def mesh(*shape: int, names: tuple[str, ...] | None = None) -> Mesh:
    names = names or ("data", "model", "extra")[: len(shape)]
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def sharded(x: np.ndarray, m: Mesh, *spec: object) -> jax.Array:
    return jax.device_put(x, NamedSharding(m, PartitionSpec(*spec)))


@pytest.fixture
def writer_runs(monkeypatch) -> list[str]:
    """The saves that ran in a writer process during the test (their locations)."""
    from snapshard.saving import writer_process

    ran: list[str] = []
    real = writer_process.WriterProcess._run

    def counted(self, prep):
        ran.append(prep.storage.url)
        return real(self, prep)

    monkeypatch.setattr(writer_process.WriterProcess, "_run", counted)
    return ran


@pytest.fixture
def ckpt(tmp_path):
    """A fresh checkpoint path (not yet created)."""
    return tmp_path / "ckpt"


def chunk_of(ckpt, path: tuple, chunk: int = 0) -> tuple[str, int, int]:
    """(data file, offset, nbytes) of chunk `chunk` (in box order) of the leaf at `path`."""
    from snapshard.format.reading import read_manifest
    from snapshard.storage import LocalStorage

    with LocalStorage(ckpt) as st:
        m = read_manifest(st)
        leaf = next(a for a in m.arrays if a.path == tuple(path))
        t = leaf.chunks
        return m.files[int(t.file[chunk])].name, int(t.offset[chunk]), int(t.nbytes[chunk])


def run_bounded(fn: Callable[[], Any], seconds: float) -> tuple[Any, BaseException | None]:
    """fn() in a thread: (its value, None) or (None, what it raised). Fails the test
    (instead of hanging it) if fn does not return within `seconds`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"call did not return within {seconds:g} s"
    return box.get("value"), box.get("error")
