"""One writer per checkpoint root: the writer lease (storage/lease.py) and the manager's use
of it, on local disk and on the S3 server, with independent processes."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

import multiproc
import snapshard
from s3env import bucket_url, store_params
from snapshard.errors import WriterLeaseError
from snapshard.storage import root_for
from snapshard.storage.lease import LEASE_DIR, WriterLease
from snapshard.storage.local_root import LocalLeaseFiles

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=["local", *store_params()])
def root_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"{bucket_url(request, request.param)}/lease-{uuid.uuid4().hex[:8]}/run"


def test_a_second_lease_is_refused_naming_the_holder_until_released(root_url):
    files = root_for(root_url).lease_files()
    a, b = WriterLease(files, timeout_s=30), WriterLease(files, timeout_s=30)
    a.acquire()
    t0 = time.monotonic()
    with pytest.raises(WriterLeaseError) as info:
        b.acquire()
    assert time.monotonic() - t0 < 2  # same host, live process: at once
    msg = str(info.value)
    assert f"pid {os.getpid()}" in msg and "host" in msg and "since" in msg
    assert info.value.holder["pid"] == os.getpid()
    a.verify()
    a.release()
    b.acquire()
    b.verify()
    b.release()
    assert files.names() == []


def test_takeover_fences_the_old_holder(root_url):
    files = root_for(root_url).lease_files()
    a, b = WriterLease(files, timeout_s=30), WriterLease(files, timeout_s=30)
    a.acquire()
    b.acquire(takeover=True)
    with pytest.raises(WriterLeaseError, match="lost its writer lease"):
        a.verify()
    a.release()  # never removes the new holder's lease
    b.verify()
    b.release()


def _fake_holder(files, gen, host, pid, beat_unix, timeout_s):
    doc = {
        "host": host,
        "pid": pid,
        "started": "then",
        "token": "x" * 32,
        "beat": 7,
        "beat_unix": beat_unix,
        "timeout_s": timeout_s,
    }
    assert files.create(f"{gen:08d}.json", json.dumps(doc).encode())
    return doc


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    files = LocalLeaseFiles(tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    import socket

    _fake_holder(files, 1, socket.gethostname(), int(dead.stdout), time.time(), 30)
    lease = WriterLease(files, timeout_s=30)
    with caplog.at_level(logging.WARNING, "snapshard"):
        lease.acquire()
    assert lease.generation == 2 and "stale writer lease" in caplog.text
    assert sorted(files.names()) == ["00000002.json"]
    lease.release()


def test_a_killed_holder_not_yet_reaped_is_taken_over_at_once(tmp_path):
    """A holder killed whose parent has not waited for it yet (a zombie: a supervisor that
    restarts the job before it reaps the old one) holds nothing."""
    import socket

    files = LocalLeaseFiles(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the kernel has made it a zombie
            with open(f"/proc/{holder.pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    break
            time.sleep(0.01)
        _fake_holder(files, 1, socket.gethostname(), holder.pid, time.time(), 30)
        lease = WriterLease(files, timeout_s=30)
        t0 = time.monotonic()
        lease.acquire()
        assert lease.generation == 2 and time.monotonic() - t0 < 5
        lease.release()
    finally:
        holder.wait()


def test_a_temporary_file_left_by_a_killed_heartbeat_goes_with_the_next_release(tmp_path):
    files = LocalLeaseFiles(tmp_path)
    lease = WriterLease(files, timeout_s=30)
    lease.acquire()
    left = files.dir / ".tmp-0123"  # a heartbeat killed between its write and its rename
    left.write_bytes(b"{}")
    os.utime(left, (time.time() - 60, time.time() - 60))
    fresh = files.dir / ".tmp-4567"  # another process's creation, in flight
    fresh.write_bytes(b"{}")
    lease.release()
    assert not left.exists() and fresh.exists()
    fresh.unlink()
    lease.acquire()
    lease.release()
    assert not files.dir.exists()


def test_a_lease_this_process_gave_up_but_could_not_remove_is_stale(tmp_path, monkeypatch):
    files = LocalLeaseFiles(tmp_path)
    first = WriterLease(files, timeout_s=30)
    first.acquire()

    def fail(self, name):
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as m:  # the removal fails: the document stays behind
        m.setattr(LocalLeaseFiles, "remove", fail)
        first.release()
    assert files.names() == ["00000001.json"]
    second = WriterLease(files, timeout_s=30)
    second.acquire()  # its holder is this process, which no longer holds it
    assert second.generation == 2
    third = WriterLease(files, timeout_s=30)
    with pytest.raises(WriterLeaseError, match=f"pid {os.getpid()}"):
        third.acquire()  # a lease this process does hold is refused as ever
    second.release()


def test_a_holder_elsewhere_is_live_while_its_heartbeat_moves(tmp_path):
    files = LocalLeaseFiles(tmp_path)
    doc = _fake_holder(files, 1, "elsewhere", 1, 0.0, 1.5)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.2):
            doc["beat"] += 1
            files.replace("00000001.json", json.dumps(doc).encode())

    t = threading.Thread(target=beat)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(WriterLeaseError, match="'elsewhere'"):
            WriterLease(files, timeout_s=1.5).acquire()
        assert time.monotonic() - t0 < 1.5
    finally:
        stop.set()
        t.join()
    # Its heartbeat stopped: after watching for the timeout, the lease is taken over.
    t0 = time.monotonic()
    lease = WriterLease(files, timeout_s=1.5)
    lease.acquire()
    assert 1.4 < time.monotonic() - t0 < 5 and lease.generation == 2
    lease.release()


def test_a_second_manager_on_a_root_fails_and_the_first_carries_on(root_url):
    tree = {"w": np.arange(8.0)}
    with snapshard.CheckpointManager(root_url) as m:
        m.save(1, tree)
        m.wait_until_finished()
        with snapshard.CheckpointManager(root_url) as second:  # a reader until it saves
            assert second.all_steps() == [1]
            with pytest.raises(WriterLeaseError, match="another writer of this process holds"):
                second.save(2, tree)
        m.save(2, tree)
        m.wait_until_finished()
        assert m.all_steps() == [1, 2]
    with snapshard.CheckpointManager(root_url) as m:  # released by close
        assert m.all_steps() == [1, 2]
        assert LEASE_DIR not in root_for(root_url).list()


def test_a_manager_that_lost_its_lease_commits_nothing(root_url):
    tree = {"w": np.arange(8.0)}
    m = snapshard.CheckpointManager(root_url, async_save=False)
    m.save(1, tree)
    thief = WriterLease(root_for(root_url).lease_files())
    thief.acquire(takeover=True)
    with pytest.raises(snapshard.BackgroundSaveError, match="lost its writer lease"):
        m.save(2, tree)
    assert root_for(root_url).list() == {"1": True}
    m.close()
    thief.release()


def _start_writer(root, steps, *extra, hold=None):
    env = dict(os.environ)
    if hold is not None:
        env["SNAPSHARD_TEST_HOLD_UNTIL"] = str(hold)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(multiproc.SRC), str(multiproc.WORKERS), env.get("PYTHONPATH", "")]
    )
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen(
        [sys.executable, str(multiproc.WORKERS / "lease_writer.py"), root, str(steps), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _wait_started(p, timeout=60):
    deadline = time.monotonic() + timeout
    assert p.stdout is not None
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line.strip() == "STARTED":
            return
        if not line and p.poll() is not None:
            break
    raise AssertionError(f"writer did not start: {p.stderr.read() if p.stderr else ''}")


def _result(p, timeout=120):
    out, err = p.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, err[-3000:]
    return json.loads(lines[-1][7:])


def test_two_independent_jobs_on_one_root_never_commit_a_broken_step(root_url, tmp_path):
    """An old job still saving when its replacement starts (three times over): the second
    fails fast naming the first, and every committed step loads."""
    steps = 12 if root_url.startswith("s3://") else 30
    last = 0
    for i in range(3):
        hold = tmp_path / f"hold-{i}"  # the first job keeps saving until the second has failed
        first = _start_writer(root_url, steps, hold=hold)
        try:
            _wait_started(first)
            second = _start_writer(root_url, steps)
            r2 = _result(second)
            hold.touch()
            assert r2.get("error_type") == "WriterLeaseError", r2
            assert f"pid {first.pid}" in r2["error"] and r2["seconds"] < 10
            r1 = _result(first)
            assert "error" not in r1, r1
            last = r1["saved"][-1]
        finally:
            hold.touch()
            multiproc.kill_all([first])
    root = root_for(root_url)
    committed = sorted(int(n) for n, ok in root.list().items() if ok)
    assert committed == [last - 2, last - 1, last]
    for step in committed:
        got = snapshard.load(root.child(str(step)))
        assert got["step"] == step and np.all(got["w"] == step)


def test_a_killed_writer_is_taken_over_by_the_next_job(root_url):
    first = _start_writer(root_url, 10_000)
    try:
        _wait_started(first)
        time.sleep(0.5)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        multiproc.kill_all([first])
    t0 = time.monotonic()
    second = _start_writer(root_url, 3, "30")
    r = _result(second)
    assert "error" not in r, r
    assert time.monotonic() - t0 < 60  # same host, process gone: no waiting for the timeout
    root = root_for(root_url)
    for step in (n for n, ok in root.list().items() if ok):
        assert snapshard.load(root.child(step))["step"] == int(step)


def test_every_process_of_a_job_learns_that_the_root_is_held(tmp_path):
    holder = WriterLease(root_for(tmp_path / "run").lease_files())
    holder.acquire()
    try:
        procs = multiproc.run("manager_start.py", 2, 1, tmp_path / "run", timeout=90)
    finally:
        holder.release()
    r0, r1 = procs[0].result(), procs[1].result()
    assert r0["error_type"] == "WriterLeaseError" and f"pid {os.getpid()}" in r0["error"]
    assert not r0["relayed"]
    # Process 1 learns it from process 0: the same type (relayed: also a CoordinationError)
    assert r1["error_type"] == "WriterLeaseError" and r1["relayed"]
    assert "WriterLeaseError" in r1["error"] and f"pid {os.getpid()}" in r1["error"]
    procs = multiproc.run("manager_start.py", 2, 1, tmp_path / "run", timeout=90)
    assert all(p.result()["ok"] for p in procs)
