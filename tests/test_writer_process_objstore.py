"""Asynchronous saves to object stores in the writer process: the same checkpoint and the
same request counts as in threads, a writer killed mid-save leaves nothing on the store,
and stores that cannot cross to another process stay in threads, saying why.

Each test of a real store runs on every configured local server (S3, GCS, Azure: see
tests/s3env.py) and is skipped where none is."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import numpy as np
import pytest

import snapshard
from s3env import fresh_prefix, store_params
from snapshard import SaveOptions
from snapshard.coordination.base import SingleProcessCoordinator
from snapshard.errors import SnapshardError
from snapshard.saving import entry, writer_process
from snapshard.storage.bucket import TransferConfig
from snapshard.storage.objstore import ObjectStorage

pytestmark = pytest.mark.timeout(180)

PROCESS = SaveOptions(background="process")
# Files of more than one request go up in parts: the writer's uploads take both paths.
SMALL = TransferConfig(
    part_size=5 << 20, single_request_bytes=5 << 20, file_bytes=None,
    read_part_size=1 << 20, max_inflight_bytes=4 << 20,
)  # fmt: skip


@pytest.fixture(params=store_params())
def prefix(request) -> str:
    return f"{fresh_prefix(request, request.param)}/run"


def tree() -> dict[str, object]:
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((1536, 1024), dtype=np.float32),  # 6 MiB: in parts
        "b": rng.standard_normal((300,), dtype=np.float32),
        "step": 7,
    }


def test_a_save_goes_up_from_the_writer_with_the_requests_counted_here(prefix, writer_runs):
    state = tree()
    here = ObjectStorage(f"{prefix}/thread", transfer=SMALL)
    snapshard.save_async(here, state, SaveOptions(background="thread")).wait()
    there = ObjectStorage(f"{prefix}/writer", transfer=SMALL)
    snapshard.save_async(there, state, PROCESS).wait()
    assert writer_runs == [there.url]
    # Every request the writer made is counted in this process's copy, as in threads.
    made, expected = dataclasses.asdict(there.stats), dataclasses.asdict(here.stats)
    for kind in ("put", "post", "delete"):
        assert made[kind] == expected[kind], (kind, made, expected)
    # (the manifests differ by a few bytes: their nonces and the numbers in them)
    assert abs(made["bytes_sent"] - expected["bytes_sent"]) < 1024, (made, expected)
    assert made["put"] > 0 and made["bytes_sent"] > state["w"].nbytes  # type: ignore[union-attr]
    out = snapshard.load(there)
    np.testing.assert_array_equal(out["w"], state["w"])
    np.testing.assert_array_equal(out["b"], state["b"])
    assert out["step"] == 7


def test_the_manager_saves_every_step_from_the_writer(prefix, writer_runs):
    with snapshard.CheckpointManager(prefix, save_options=PROCESS) as manager:
        for step in (1, 2):
            manager.save(step, {"a": np.full(1000, step, np.int32)})
        manager.wait_until_finished()
        assert manager.all_steps() == [1, 2]
        assert snapshard.load(f"{prefix}/2")["a"].tolist() == [2] * 1000
    assert len(writer_runs) == 2


class _KillsTheWriter(SingleProcessCoordinator):
    """Kills the writer process when it reports its files written: every data file is up,
    nothing is committed."""

    def set(self, key: str, value: str) -> None:
        if "/written/" in key:
            os.kill(writer_process._writer.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
            writer_process._writer.proc.wait()  # type: ignore[union-attr]
            raise OSError("killed")
        super().set(key, value)


def test_a_writer_killed_mid_save_leaves_nothing_on_the_store(prefix, monkeypatch):
    def not_here(prep):
        raise AssertionError("the save ran in threads")

    state = tree()
    storage = ObjectStorage(f"{prefix}/x", transfer=SMALL)
    monkeypatch.setattr(entry, "finish_here", not_here)
    save = snapshard.save_async(storage, state, PROCESS, coordinator=_KillsTheWriter())
    with pytest.raises(SnapshardError, match="the writer process was killed by SIGKILL"):
        save.wait()
    assert not storage.is_committed() and storage.client.listing() == {}
    snapshard.save_async(storage, state, PROCESS).wait()  # a new writer
    np.testing.assert_array_equal(snapshard.load(storage)["w"], state["w"])


def test_stores_that_cannot_cross_processes_stay_in_threads_saying_why(
    caplog, writer_runs, monkeypatch
):
    monkeypatch.setattr(writer_process, "_told", set())

    def provider() -> dict[str, object]:  # a closure: it does not pickle
        return {}

    unsendable = ObjectStorage("s3://bucket/run/x", {"credential_provider": provider})
    assert "cannot be sent to another process" in (unsendable.unportable() or "")
    with caplog.at_level(logging.WARNING, "snapshard"):
        for name in ("a", "b"):
            url = f"memory://writer-{os.getpid()}/run/{name}"
            snapshard.save_async(url, {"a": np.arange(5)}, PROCESS).wait()
            assert snapshard.load(url)["a"].tolist() == [0, 1, 2, 3, 4]
    said = [r for r in caplog.records if "memory:// store lives in its own" in r.getMessage()]
    assert len(said) == 1 and writer_runs == []
