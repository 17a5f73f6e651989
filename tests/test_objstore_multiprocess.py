"""Two real processes save to each local object-store server (S3, GCS, Azure); restores on other topologies are bit-exact;
a save whose committing process is killed before the marker never becomes visible; a failed
upload on one process fails the save everywhere, commits nothing, and the job run again saves."""

from __future__ import annotations

import pytest

import multiproc
from snapshard.storage.objstore import ObjectRoot

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def base(remote_prefix):
    return remote_prefix


def test_two_processes_save_and_restore_resharded(base):
    ckpt = f"{base}/ckpt"
    saved = multiproc.run("save_restore.py", 2, 4, "save", ckpt, timeout=120)
    for p in saved:
        r = p.result()
        assert r["ok"] and r["requests"]["put"] >= 2, r
    assert ObjectRoot(base).list() == {"ckpt": True}
    # (processes, devices each, mesh rows, spec): columns of 2 processes, rows of 1 process.
    for n, d, rows, spec in ((2, 4, 2, "cols"), (1, 8, 4, "rows")):
        for p in multiproc.run("save_restore.py", n, d, "restore", ckpt, rows, spec, timeout=120):
            r = p.result()
            assert r["ok"], f"{n} processes, {spec}: process {p.process_id} restored wrong values"
            stats = r["stats"]
            assert stats["bytes_read"] <= 1.05 * stats["bytes_needed"], stats
            # Everything that came over the wire was asked for (plus the manifest).
            assert r["requests"]["bytes_received"] < stats["bytes_read"] + 64 << 10
            assert r["requests"]["put"] == 0


def test_a_save_killed_before_its_marker_is_never_committed_and_is_cleaned(base):
    procs = multiproc.run(
        "save_restore.py",
        2,
        4,
        "save",
        f"{base}/ckpt",
        "--kill-before-commit",
        0,
        "--timeout",
        5,
        timeout=90,
        check=False,
    )
    assert procs[0].returncode == -9, procs[0].stderr[-2000:]
    # Process 0 also ran the coordination service: its peer fails or is aborted by JAX.
    assert procs[1].returncode != 0
    root = ObjectRoot(base)
    assert root.list() == {"ckpt": False}
    left = root.child("ckpt").client.listing()
    assert "manifest.json" in left and "COMMITTED" not in left
    root.remove_incomplete("ckpt")
    assert root.list() == {}


def test_a_failed_upload_on_one_process_fails_the_save_everywhere(base):
    ckpt = f"{base}/ckpt"
    args = ("save_restore.py", 2, 4, "save", ckpt, "--fail-in-write", 1, "--timeout", 60)
    procs = multiproc.run(*args, timeout=90, check=False)
    assert [p.returncode for p in procs] == [3, 3]
    own, seen = procs[1].result()["error"], procs[0].result()["error"]
    assert own.startswith(f"StorageError: {ckpt}: upload of 'data/") and "injected fault" in own
    assert "process 1 failed: StorageError" in seen
    assert ObjectRoot(base).list().get("ckpt") is not True
    assert all(p.result()["ok"] for p in multiproc.run(*args[:5], timeout=90))
    assert ObjectRoot(base).list() == {"ckpt": True}
