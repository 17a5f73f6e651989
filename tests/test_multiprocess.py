"""Several real processes joined by jax.distributed: save on one topology, restore on others."""

from __future__ import annotations

import json

import numpy as np
import pytest

import multiproc

pytestmark = pytest.mark.multiprocess

# (processes, devices per process, restore mesh rows, spec)
TOPOLOGIES = {
    "2x4": (2, 4, 2, "rows"),
    "1x8": (1, 8, 4, "rows"),
    "8x1": (8, 1, 0, "flat"),
    "4x2": (4, 2, 2, "rows"),
}


def save_on(ckpt, procs, devices, *extra, check=True, timeout=120, env=None):
    return multiproc.run(
        "save_restore.py", procs, devices, "save", ckpt, *extra, timeout=timeout, check=check,
        env=env,
    )  # fmt: skip


def restore_on(ckpt, topology):
    n, d, rows, spec = TOPOLOGIES[topology]
    return multiproc.run("save_restore.py", n, d, "restore", ckpt, rows, spec, timeout=120)


@pytest.fixture(scope="module")
def saved_4x2(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("mp") / "ckpt"
    procs = save_on(ckpt, 4, 2)
    return ckpt, procs


@pytest.mark.parametrize("topology", ["2x4", "1x8", "8x1"])
def test_saved_on_4x2_restores_on_other_topologies(saved_4x2, topology):
    ckpt, _ = saved_4x2
    for p in restore_on(ckpt, topology):
        r = p.result()
        assert r["ok"], f"process {p.process_id} restored wrong values"
        stats = r["stats"]
        assert stats["bytes_read"] <= 1.05 * stats["bytes_needed"], stats


@pytest.fixture(scope="module")
def restored_on_4x2(tmp_path_factory):
    """A checkpoint saved on each of the other topologies, then all of them restored in
    turn by one job on 4x2: {source: each process's result}."""
    base = tmp_path_factory.mktemp("sources")
    ckpts = {}
    for source in ("2x4", "1x8", "8x1"):
        n, d, _, _ = TOPOLOGIES[source]
        ckpts[source] = base / source
        save_on(ckpts[source], n, d)
    n, d, rows, spec = TOPOLOGIES["4x2"]
    procs = multiproc.run("save_restore.py", n, d, "restores", rows, spec, *ckpts.values())
    by_ckpt = [{r["case"]: r for r in p.results} for p in procs]
    return {source: [got.get(str(ckpt)) for got in by_ckpt] for source, ckpt in ckpts.items()}


@pytest.mark.parametrize("source", ["2x4", "1x8", "8x1"])
def test_saved_on_other_topologies_restores_on_4x2(restored_on_4x2, source):
    for r in restored_on_4x2[source]:
        assert r is not None and r["ok"], r
        assert r["stats"]["bytes_read"] <= 1.05 * r["stats"]["bytes_needed"]


def test_manifest_bytes_are_the_unique_bytes_and_writes_are_balanced(saved_4x2):
    ckpt, procs = saved_4x2
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    unique = 1024 * 512 * 4 + 512 * 256 * 2 + 512 * 4 + 7 * 5 * 4 + 10 * 8 + 8 * 2 * 4
    assert doc["total_bytes"] == unique
    assert doc["process_count"] == 4
    written = [p.result()["bytes_written"] for p in procs]
    assert sum(written) == unique
    assert max(written) / np.mean(written) <= 1.05
    # Every process wrote its own files.
    assert sorted(p.name[:6] for p in (ckpt / "index").iterdir()) == [f"p0000{i}" for i in range(4)]


def test_a_process_killed_during_save_commits_nothing(tmp_path):
    older = tmp_path / "older"
    save_on(older, 2, 4)
    before = {p.name: p.read_bytes() for p in older.rglob("*") if p.is_file()}
    ckpt = tmp_path / "ckpt"
    # JAX's own heartbeat check (10 s by default) must not abort the survivors before
    # snapshard's 5 s timeout names process 2 and they exit: under load it sometimes did.
    procs = save_on(
        ckpt, 4, 2, "--kill-in-write", 2, "--timeout", 5, check=False, timeout=90,
        env={"SNAPSHARD_TEST_HEARTBEAT_S": "60"},
    )  # fmt: skip
    assert procs[2].returncode == -9
    for p in procs:
        if p.process_id != 2:
            assert p.returncode == 3, p.stderr[-2000:]
            assert (
                "process(es) [2]" in p.result()["error"] or "did not report" in p.result()["error"]
            )
    assert not ckpt.exists()
    assert {p.name: p.read_bytes() for p in older.rglob("*") if p.is_file()} == before


def test_a_process_raising_during_save_fails_everyone_quickly(tmp_path):
    ckpt = tmp_path / "ckpt"
    procs = save_on(ckpt, 2, 4, "--fail-in-write", 1, "--timeout", 60, check=False, timeout=60)
    assert all(p.returncode == 3 for p in procs)
    # Process 1's write failed below the storage layer: a StorageError naming the file,
    # which process 0 names too; nothing is committed, and the job run again saves.
    own, seen = procs[1].result()["error"], procs[0].result()["error"]
    assert own.startswith("StorageError: write (at byte 0) of ") and "injected fault" in own
    assert f"{ckpt}.snapshard-tmp" in own
    assert "process 1 failed: StorageError: write (at byte 0)" in seen
    assert not ckpt.exists()
    assert all(p.result()["ok"] for p in save_on(ckpt, 2, 4, timeout=60))


def test_managed_async_saves_on_two_processes_use_no_barrier(tmp_path):
    procs = multiproc.run("managed.py", 2, 4, tmp_path / "run", 5, timeout=120)
    for p in procs:
        r = p.result()
        assert r["ok"] and r["steps"] == [4, 5]
        # The manager's start-up costs no barrier: process 0 publishes the outcome of taking
        # the writer lease and cleaning up, the others wait for it. Each save costs no
        # barrier; process 0 reads the reports by listings of their directory, waiting (when
        # they are not all in at once) on the one key the last report sets, never on one key
        # per process (and again only after a second: one save here takes less, bar a
        # loaded machine); the others wait once for the outcome.
        assert r["at_start"]["barrier"] == 0
        # The outcome of process 0's start-up; and the job token, read by whoever set it second.
        assert r["at_start"]["get"] <= (1 if r["pid"] == 0 else 2)
        assert r["per_save"]["barrier"] == 0
        # The others wait once more at the first save, which makes the manager the writer
        # (the lease and the clean-up): 6 waits over 5 saves.
        if r["pid"] == 0:
            assert r["per_save"]["get"] <= 2
        else:
            assert r["per_save"]["get"] == 6 / 5


def test_without_the_preemption_service_processes_agree_on_the_step_through_the_store(
    tmp_path,
):
    # Only process 1 is preempted, at step 3, once process 0 has checked step 3: both save
    # at step 4, and it restores.
    procs = multiproc.run("preempt_jax.py", 2, 2, tmp_path / "run", timeout=120)
    for p in procs:
        r = p.result()
        assert r["agreed"] == 4 and r["steps"] == [4] and r["ok"], r


def test_incremental_managed_saves_on_two_processes(tmp_path):
    procs = multiproc.run("incremental_procs.py", 2, 4, tmp_path / "run", 5, timeout=180)
    total = [0] * 5
    for p in procs:
        r = p.result()
        assert r["ok"] and r["steps"] == [4, 5]
        total = [a + b for a, b in zip(total, r["written"], strict=True)]
    # step 1 writes everything; later steps only the trained array (64 x 32 f32)
    assert total[0] == 256 * 64 * 4 + 64 * 32 * 4
    assert total[1:] == [64 * 32 * 4] * 4
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if not p.name.startswith("."))
    assert names == ["1", "4", "5"]
