"""Readers are not writers: managers that only list and restore take no writer lease and
work beside a live writer; a manager takes the lease at its first save (or when made, with
LeasePolicy(at_start=True)); two writers in one process are told apart from two jobs; and
torchtitan's world-size error gives torchtitan's fix."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import multiproc
import snapshard
from snapshard.errors import WriterLeaseError
from snapshard.manager import LeasePolicy, ManagerPolicies
from snapshard.storage import root_for
from snapshard.storage.lease import LEASE_DIR, WriterLease
from snapshard.storage.stale_staging import STAGING_SUFFIX

pytestmark = pytest.mark.timeout(240)


def state(step: int) -> dict:
    return {"w": np.full((8, 4), step, np.float32), "step": step}


def lease_pids(root: Path) -> list[int]:
    """The pids of the writer lease's documents under `root` (none: no lease directory)."""
    d = root / LEASE_DIR
    if not d.is_dir():
        return []
    return [json.loads(p.read_text())["pid"] for p in sorted(d.glob("*.json"))]


def test_a_manager_made_and_closed_without_saving_leaves_no_lease(tmp_path):
    snapshard.CheckpointManager(tmp_path).close()
    snapshard.CheckpointManager(tmp_path, read_only=True).close()
    assert not (tmp_path / LEASE_DIR).exists()
    with snapshard.CheckpointManager(tmp_path) as m:
        m.save(1, state(1))
        m.wait_until_finished()
        assert lease_pids(tmp_path) == [os.getpid()]  # taken by the first save
    assert not (tmp_path / LEASE_DIR).exists()  # and given up by close


def test_one_writer_and_readers_in_one_process(tmp_path):
    writer = snapshard.CheckpointManager(tmp_path, async_save=False)
    try:
        writer.save(1, state(1))
        with (
            snapshard.CheckpointManager(tmp_path, read_only=True) as a,
            snapshard.CheckpointManager(tmp_path, read_only=True) as b,
            snapshard.CheckpointManager(tmp_path) as plain,
        ):
            assert a.all_steps() == b.all_steps() == plain.all_steps() == [1]
            assert a.should_save(2) is False
            with pytest.raises(ValueError, match="read_only: it restores and lists"):
                a.save(2, state(2))
            writer.save(2, state(2))
            assert a.latest_step() == 1  # a reader's listing is the one it made
            assert a.restore(2)["step"] == 2  # a step not in it: listed again first
            assert a.latest_step() == 2
            b.reload()
            assert b.all_steps() == [1, 2] and b.restore()["step"] == 2
            assert np.all(plain.restore(1)["w"] == 1)
            assert lease_pids(tmp_path) == [os.getpid()]  # the writer's document alone
            writer.save(3, state(3))
        assert writer.all_steps() == [1, 2, 3]
    finally:
        writer.close()
    assert not (tmp_path / LEASE_DIR).exists()


def test_a_second_writer_in_one_process_is_named_not_taken_for_another_job(tmp_path):
    first = snapshard.CheckpointManager(tmp_path, async_save=False)
    line = 1 + _line_of("first = snapshard.CheckpointManager(tmp_path, async_save=False)")
    second = snapshard.CheckpointManager(tmp_path, async_save=False)  # a reader until it saves
    try:
        first.save(1, state(1))
        assert second.restore(1)["step"] == 1
        with pytest.raises(WriterLeaseError) as info:
            second.save(2, state(2))
        msg = str(info.value)
        assert "another writer of this process holds" in msg
        assert f"CheckpointManager created at {__file__}:{line}" in msg
        assert "close that one first" in msg and "save through it" in msg
        assert "takeover" not in msg and "another writer holds this checkpoint root" not in msg
        first.save(2, state(2))  # the first carries on
        first.close()
        second.save(3, state(3))  # and once it is closed, the second writes
        assert second.all_steps() == [1, 2, 3]
    finally:
        first.close()
        second.close()


def _line_of(text: str) -> int:
    """The line of this file holding `text` (0-based), for messages that name a line."""
    return Path(__file__).read_text().splitlines().index("    " + text)


def test_at_start_takes_the_lease_when_the_manager_is_made(tmp_path):
    staged = tmp_path / ("3" + STAGING_SUFFIX)
    (staged / "data").mkdir(parents=True)  # what a crashed save (or a live one) left
    reader = snapshard.CheckpointManager(tmp_path)
    assert staged.is_dir() and not (tmp_path / LEASE_DIR).exists()  # a reader removes nothing
    reader.close()
    eager = ManagerPolicies(lease=LeasePolicy(at_start=True))
    with snapshard.CheckpointManager(tmp_path, policies=eager) as m:
        assert lease_pids(tmp_path) == [os.getpid()] and not staged.exists()
        with pytest.raises(WriterLeaseError, match="another writer of this process holds"):
            snapshard.CheckpointManager(tmp_path, policies=eager)
        m.save(1, state(1))
    with pytest.raises(ValueError, match="read_only"):
        snapshard.CheckpointManager(tmp_path, read_only=True, policies=eager)
    (staged / "data").mkdir(parents=True)
    with snapshard.CheckpointManager(tmp_path, async_save=False) as m:
        assert staged.is_dir()
        m.save(2, state(2))  # the first save is a writer's start: the clean-up with the lease
        assert not staged.exists() and m.all_steps() == [1, 2]


def test_a_reader_does_not_list_a_step_deleted_while_it_lists(tmp_path, monkeypatch):
    with snapshard.CheckpointManager(tmp_path, async_save=False) as m:
        for step in (1, 2, 3):
            m.save(step, state(step))
    from snapshard.manager import listing

    read_summary = listing.read_summary

    def deleted_first(storage):  # a writer's retention deletes step 2 after the listing
        if storage.url.endswith(f"{os.sep}2"):
            storage.delete()
        return read_summary(storage)

    monkeypatch.setattr(listing, "read_summary", deleted_first)
    with snapshard.CheckpointManager(tmp_path, read_only=True) as r:
        assert r.all_steps() == [1, 3]
        with pytest.raises(snapshard.CheckpointNotFoundError, match=r"its steps: 1, 3"):
            r.restore(2)


def _writer(tmp_path: Path, stop: Path):
    procs = multiproc.start("titan_beside.py", 1, 1, ["write", str(tmp_path), str(stop)])
    watchdog = threading.Timer(180, multiproc.kill_all, [procs])  # a hung writer ends
    watchdog.start()
    return procs, watchdog


def _wait_line(proc, want: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == want:
            return
    raise AssertionError(f"the writer ended before {want!r}: {proc.stderr.read()[-3000:]}")


def _finish(procs, watchdog) -> dict:
    try:
        done = multiproc.collect(procs, timeout=120)
    finally:
        watchdog.cancel()
    assert done[0].returncode == 0, done[0].stderr[-3000:]
    return done[0].result()


def test_a_step_deleted_while_it_is_read_is_not_found_not_damaged(tmp_path, monkeypatch, capsys):
    """A writer's retention deletes step 1 after a reader read its manifest: the reader's
    restore, `verify` and `ls` say the step is gone (not found: verify exits 2), never
    that it is damaged (exit 1, or "unreadable")."""
    from snapshard.cli import main
    from snapshard.errors import CheckpointNotFoundError
    from snapshard.storage.local import LocalStorage

    real = LocalStorage.read_manifest
    armed: list[str] = []

    def read_then_deleted(self: LocalStorage) -> bytes:
        when = armed.pop() if armed and self.final.name == "1" else None
        if when == "before":  # deleted once listed (what `ls` meets)
            LocalStorage(self.final).delete()
        data = real(self)
        if when == "after":  # what retention does, beside this reader
            LocalStorage(self.final).delete()
        return data

    monkeypatch.setattr(LocalStorage, "read_manifest", read_then_deleted)
    for how in ("restore", "verify", "ls"):
        root = tmp_path / how
        with snapshard.CheckpointManager(root, async_save=False) as writer:
            for step in (1, 2):
                writer.save(step, {"w": np.arange(1 << 16, dtype=np.float32)})
        reader = snapshard.CheckpointManager(root, read_only=True)  # (its listing reads)
        armed.append("before" if how == "ls" else "after")
        if how == "restore":
            with pytest.raises(CheckpointNotFoundError, match="deleted while it was read"):
                reader.restore(1)
            assert reader.restore(2)["w"][-1] == (1 << 16) - 1
        elif how == "verify":
            assert main(["verify", str(root / "1")]) == 2
            assert "deleted while it was read" in capsys.readouterr().err
        else:
            assert main(["ls", str(root)]) == 0
            rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:]]
            assert rows == [["2", "complete"]], rows


def test_an_object_store_step_deleted_while_it_is_read_is_not_found(monkeypatch):
    """The same on an object store: the commit marker goes first when a step is deleted."""
    import uuid

    from snapshard.errors import CheckpointNotFoundError
    from snapshard.storage.objstore import ObjectStorage

    url = f"memory://beside-{uuid.uuid4().hex[:8]}/run/1"
    snapshard.save(url, {"w": np.arange(1 << 16, dtype=np.float32)})
    real = ObjectStorage.read_manifest

    def read_then_deleted(self: ObjectStorage) -> bytes:
        data = real(self)
        self.delete()  # what retention does, beside this reader
        return data

    monkeypatch.setattr(ObjectStorage, "read_manifest", read_then_deleted)
    with pytest.raises(CheckpointNotFoundError, match="deleted while it was read"):
        snapshard.load(url)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_checkpoint_overwritten_while_it_is_read_is_not_found_not_damaged(
    tmp_path, monkeypatch, capsys, where
):
    """A save with overwrite=True replaces the checkpoint after a reader read its manifest:
    the reader's load and `verify` say it was replaced (not found: read it again), never
    that it is damaged; the next load reads the new one."""
    import uuid

    from snapshard.cli import main
    from snapshard.errors import CheckpointNotFoundError
    from snapshard.storage.local import LocalStorage
    from snapshard.storage.objstore import ObjectStorage

    cls = LocalStorage if where == "local" else ObjectStorage
    url = str(tmp_path / "c") if where == "local" else f"memory://over-{uuid.uuid4().hex[:8]}/c"
    snapshard.save(url, {"w": np.zeros(1 << 16, np.float32)})
    real, armed = cls.read_manifest, [1, 2] if where == "local" else [1]  # (verify: local)

    def read_then_overwritten(self):
        data = real(self)
        if armed:  # what another job's overwrite does, beside this reader
            snapshard.save(url, {"w": np.full(1 << 16, armed.pop(), np.float32)}, overwrite=True)
        return data

    monkeypatch.setattr(cls, "read_manifest", read_then_overwritten)
    with pytest.raises(CheckpointNotFoundError, match="replaced while it was read"):
        snapshard.load(url)
    if where == "local":
        capsys.readouterr()
        assert main(["verify", url]) == 2
        assert "replaced while it was read" in capsys.readouterr().err
    assert snapshard.load(url)["w"][0] == 1


def test_a_readers_restore_of_the_newest_step_lists_again(tmp_path):
    """A reader's listing ([1, 2]) whose every step the writer's retention deleted since:
    restore() restores the newest step there is now."""
    with snapshard.CheckpointManager(tmp_path, max_to_keep=2, async_save=False) as writer:
        for step in (1, 2):
            writer.save(step, {"step": np.full(4, step)})
        reader = snapshard.CheckpointManager(tmp_path, read_only=True)
        assert reader.all_steps() == [1, 2]
        for step in (3, 4, 5):
            writer.save(step, {"step": np.full(4, step)})
    assert reader.restore()["step"].tolist() == [5] * 4
    assert reader.all_steps() == [4, 5]


def test_readers_list_and_restore_beside_a_live_writer(tmp_path):
    pytest.importorskip("torchtitan.components.checkpointer")
    from workers.titan_beside import build, manager

    folder = tmp_path / "ckpt"
    stop = tmp_path / "stop"
    procs, watchdog = _writer(tmp_path, stop)
    writer = procs[0]
    try:
        _wait_line(writer, "COMMITTED 1")
        loaded = []
        for _ in range(3):  # torchtitan's load_only manager: an evaluation job
            model, loader, train_state = build(0, 1)
            titan = manager(str(tmp_path), model, loader, train_state, load_only=True)
            assert titan.load() is True
            values = {float(v) for p in model.parameters() for v in p.detach().flatten()}
            assert values == {float(train_state.step)}  # one committed step, whole
            loaded.append(train_state.step)
            assert titan.save(train_state.step + 100, last_step=True) is False
            titan.close()
            assert set(lease_pids(folder)) == {writer.pid}  # the writer's, never the reader's
        assert loaded == sorted(loaded)

        with snapshard.CheckpointManager(folder) as plain:  # used only to list and restore
            first = plain.latest_step()
            got = plain.restore(first)
            assert got["train_state"]["step"] == first and np.all(got["model"]["0.weight"] == first)
            deadline = time.monotonic() + 60
            while plain.latest_step() == first and time.monotonic() < deadline:
                time.sleep(0.05)
                plain.reload()
            newer = plain.latest_step()
            assert newer > first and plain.restore(newer)["train_state"]["step"] == newer
            newest = _newest_after(folder, newer, deadline)
            assert newest > newer and newest not in plain.all_steps()
            assert plain.restore(newest)["train_state"]["step"] == newest  # listed again
        assert set(lease_pids(folder)) == {writer.pid}
        _newest_after(folder, 12, deadline)  # retention (keep 10) has deleted steps by now
    finally:
        stop.touch()
        result = _finish(procs, watchdog)
    saved = result["saved"]
    assert result["pid"] == writer.pid and len(saved) > 12
    assert sorted(int(n) for n, ok in root_for(folder).list().items() if ok) == saved[-10:]
    assert not (folder / LEASE_DIR).exists()  # the writer gave it up; no reader left one


def _newest_after(folder: Path, step: int, deadline: float) -> int:
    """The newest committed step under `folder` once it is past `step` (or at `deadline`)."""
    while True:
        newest = max(int(n) for n, ok in root_for(folder).list().items() if ok)
        if newest > step or time.monotonic() > deadline:
            return newest
        time.sleep(0.05)


def test_torchtitan_maybe_wait_for_saving_waits_for_the_commit(tmp_path):
    pytest.importorskip("torchtitan.components.checkpointer")
    from workers.titan_beside import build, manager

    model, loader, train_state = build(0, 1)
    mgr = manager(str(tmp_path), model, loader, train_state, interval=1)
    assert mgr.save(1, last_step=False) is True
    assert mgr.save_future is not None  # torchtitan's base class waits only while it is set
    mgr.maybe_wait_for_saving()
    assert mgr.save_future is None and root_for(tmp_path / "ckpt").list() == {"1": True}
    mgr.close()


def test_torchtitan_on_another_world_size_is_told_to_exclude_the_dataloader(tmp_path):
    pytest.importorskip("torchtitan.components.checkpointer")
    import torch

    from workers.titan_beside import build, manager

    model, loader, train_state = build(0, 1)  # one rank saves step 1, data loader included
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    train_state.step = 1
    one = manager(str(tmp_path), model, loader, train_state, interval=1)
    assert one.save(1, last_step=False) is True
    one.close()
    held = tmp_path / "held"
    holder = WriterLease(root_for(held).lease_files(), timeout_s=30)
    holder.acquire()  # another job's writer, live
    try:
        ranks = multiproc.run("titan_beside.py", 2, 1, "load", tmp_path, held, timeout=150)
    finally:
        holder.release()
    for p in ranks:
        r = p.result()
        as_is = r["as_is"]
        assert as_is["type"] == "TargetMismatchError"
        msg = as_is["error"]
        assert "saved per rank by 1 rank(s), and this job has 2" in msg
        assert 'exclude_from_loading = ["dataloader"]' in msg
        assert "--checkpoint.exclude_from_loading dataloader" in msg and "resplit" not in msg
        assert "resplit" in as_is["cause"]  # the core's error, kept as the cause
        # the advised fix works: everything but the data loader, from the one-rank step
        assert r["loaded"] is True and r["step"] == 1 and r["values"] == [1.0]
        # beside the held lease a manager lists; its save is refused on every rank
        assert r["steps"] == []
        refused = r["refused"]
        assert refused["type"] == "WriterLeaseError", refused
        assert f"pid {os.getpid()}" in refused["error"]
        assert refused["relayed"] is (r["rank"] == 1)  # rank 1 learns it from rank 0
    assert lease_pids(held) == []
