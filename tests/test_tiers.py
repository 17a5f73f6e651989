"""The local tier with peer copies, on 4 real processes: lost nodes restore from peers."""

from __future__ import annotations

import shutil

import pytest

import multiproc
from snapshard.jax.local_tier import peers

pytestmark = pytest.mark.multiprocess


def test_peers_sit_on_other_hosts():
    assert peers(0, 4, 1, 1) == [1]
    assert peers(3, 4, 2, 1) == [0, 1]
    # two processes per host: process 0 and 1 share a host, their copies go to the next host
    assert peers(0, 8, 1, 2) == [2] and peers(1, 8, 3, 2) == [3, 5, 7]
    assert peers(0, 2, 1, 2) == []  # one host: no other host to copy to


def save(tmp_path, steps=5, every=2):
    procs = multiproc.run(
        "tiers.py",
        4,
        2,
        "save",
        tmp_path / "persistent",
        tmp_path / "local",
        steps,
        every,
        timeout=180,
    )
    return [p.result() for p in procs]


def restore(tmp_path):
    procs = multiproc.run(
        "tiers.py", 4, 2, "restore", tmp_path / "persistent", tmp_path / "local", timeout=180
    )
    return [p.result() for p in procs]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("tiers")
    results = save(base)
    return base, results


def fresh_copy(saved, tmp_path):
    base, _ = saved
    shutil.copytree(base / "persistent", tmp_path / "persistent")
    shutil.copytree(base / "local", tmp_path / "local")
    return tmp_path


def test_both_tiers_hold_their_steps(saved):
    base, results = saved
    assert all(r["persistent"] == [2, 4] for r in results)
    for p in range(4):
        steps = sorted(int(d.name) for d in (base / "local" / f"process-{p:05d}").iterdir())
        assert steps == [3, 4, 5]
        assert sorted(c.name for c in (base / "local" / f"process-{p:05d}" / "5").iterdir()) == [
            "own",
            f"peer-{(p - 1) % 4:05d}",
        ]
    report = results[0]["reports"]["4"]
    assert report["local_bytes"] > 0 and report["persistent_bytes"] > 0 and report["blocking_s"] > 0


def test_newest_complete_local_step_is_preferred_and_reads_nothing_persistent(saved, tmp_path):
    root = fresh_copy(saved, tmp_path)
    for r in restore(root):
        assert r["ok"] and r["step"] == 5 and r["restore"]["tier"] == "local"
        assert r["restore"]["bytes_read_persistent"] == 0


def test_a_lost_node_restores_from_its_peer(saved, tmp_path):
    root = fresh_copy(saved, tmp_path)
    shutil.rmtree(root / "local" / "process-00002")
    results = restore(root)
    for r in results:
        assert r["ok"] and r["step"] == 5
        assert r["restore"]["bytes_read_persistent"] == 0
    assert results[2]["restore"]["tier"] == "peer" and results[2]["restore"]["bytes_from_peers"] > 0
    # The lost node's local copy is back.
    assert (root / "local" / "process-00002" / "5" / "own" / "manifest.json").exists()


def test_without_any_local_tier_the_persistent_tier_serves(saved, tmp_path):
    root = fresh_copy(saved, tmp_path)
    shutil.rmtree(root / "local")
    for r in restore(root):
        assert r["ok"] and r["step"] == 4 and r["restore"]["tier"] == "persistent"
        assert r["restore"]["bytes_read_persistent"] > 0


def test_incomplete_local_steps_are_ignored(saved, tmp_path):
    root = fresh_copy(saved, tmp_path)
    # Step 5 of process 1 is gone everywhere (its own copy and its peer's copy); step 6 is
    # a save that died before its commit.
    shutil.rmtree(root / "local" / "process-00001" / "5" / "own")
    shutil.rmtree(root / "local" / "process-00002" / "5" / "peer-00001")
    (root / "local" / "process-00000" / "6.snapshard-tmp" / "own").mkdir(parents=True)
    for r in restore(root):
        # Local step 4 is complete but not newer than persistent step 4: the rule picks persistent.
        assert r["ok"] and r["step"] == 4 and r["restore"]["tier"] == "persistent"


def _flip_a_byte(copy):
    f = sorted((copy / "data").iterdir())[0]
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def test_a_corrupt_own_copy_is_skipped_for_the_peers_copy(saved, tmp_path):
    root = fresh_copy(saved, tmp_path)
    _flip_a_byte(root / "local" / "process-00002" / "5" / "own")
    results = restore(root)
    for r in results:
        assert r["ok"] and r["step"] == 5 and r["restore"]["bytes_read_persistent"] == 0
        assert any(s.startswith("process 2 step 5") for s in r["restore"]["skipped"])
    assert results[2]["restore"]["tier"] == "peer"


def test_corrupt_own_and_peer_copies_fall_back_to_the_persistent_tier(saved, tmp_path):
    root = fresh_copy(saved, tmp_path)
    _flip_a_byte(root / "local" / "process-00002" / "5" / "own")
    _flip_a_byte(root / "local" / "process-00003" / "5" / "peer-00002")
    for r in restore(root):
        assert r["ok"] and r["step"] == 4 and r["restore"]["tier"] == "persistent"
        assert r["restore"]["skipped"]
