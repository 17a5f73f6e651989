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


def _flip_a_byte(copy):
    f = sorted((copy / "data").iterdir())[0]
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


def _lose_node_2(root):
    shutil.rmtree(root / "local" / "process-00002")


def _lose_the_local_tier(root):
    shutil.rmtree(root / "local")


def _leave_incomplete_local_steps(root):
    # Step 5 of process 1 is gone everywhere (its own copy and its peer's copy); step 6 is
    # a save that died before its commit.
    shutil.rmtree(root / "local" / "process-00001" / "5" / "own")
    shutil.rmtree(root / "local" / "process-00002" / "5" / "peer-00001")
    (root / "local" / "process-00000" / "6.snapshard-tmp" / "own").mkdir(parents=True)


def _corrupt_own_copy(root):
    _flip_a_byte(root / "local" / "process-00002" / "5" / "own")


def _corrupt_own_and_peer_copies(root):
    _flip_a_byte(root / "local" / "process-00002" / "5" / "own")
    _flip_a_byte(root / "local" / "process-00003" / "5" / "peer-00002")


# What each restore test does to a fresh copy of the saved tiers before restoring it.
CASES = {
    "as-saved": lambda root: None,
    "lost-node": _lose_node_2,
    "no-local-tier": _lose_the_local_tier,
    "incomplete-local-steps": _leave_incomplete_local_steps,
    "corrupt-own-copy": _corrupt_own_copy,
    "corrupt-own-and-peer": _corrupt_own_and_peer_copies,
}


@pytest.fixture(scope="module")
def restored(saved, tmp_path_factory):
    """Each case's copy restored by a fresh manager, the copies one after the other in one
    job of 4 processes: {case: (its root, each process's result)}."""
    roots = {}
    for case, change in CASES.items():
        roots[case] = fresh_copy(saved, tmp_path_factory.mktemp(case))
        change(roots[case])
    procs = multiproc.run("tiers.py", 4, 2, "restores", *roots.values(), timeout=240)
    by_root = [{r["case"]: r for r in p.results} for p in procs]
    return {case: (root, [got.get(str(root)) for got in by_root]) for case, root in roots.items()}


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


def test_newest_complete_local_step_is_preferred_and_reads_nothing_persistent(restored):
    for r in restored["as-saved"][1]:
        assert r["ok"] and r["step"] == 5 and r["restore"]["tier"] == "local"
        assert r["restore"]["bytes_read_persistent"] == 0


def test_a_lost_node_restores_from_its_peer(restored):
    root, results = restored["lost-node"]
    for r in results:
        assert r["ok"] and r["step"] == 5
        assert r["restore"]["bytes_read_persistent"] == 0
    assert results[2]["restore"]["tier"] == "peer" and results[2]["restore"]["bytes_from_peers"] > 0
    # The lost node's local copy is back.
    assert (root / "local" / "process-00002" / "5" / "own" / "manifest.json").exists()


def test_without_any_local_tier_the_persistent_tier_serves(restored):
    for r in restored["no-local-tier"][1]:
        assert r["ok"] and r["step"] == 4 and r["restore"]["tier"] == "persistent"
        assert r["restore"]["bytes_read_persistent"] > 0


def test_incomplete_local_steps_are_ignored(restored):
    for r in restored["incomplete-local-steps"][1]:
        # Local step 4 is complete but not newer than persistent step 4: the rule picks persistent.
        assert r["ok"] and r["step"] == 4 and r["restore"]["tier"] == "persistent"


def test_a_corrupt_own_copy_is_skipped_for_the_peers_copy(restored):
    results = restored["corrupt-own-copy"][1]
    for r in results:
        assert r["ok"] and r["step"] == 5 and r["restore"]["bytes_read_persistent"] == 0
        assert any(s.startswith("process 2 step 5") for s in r["restore"]["skipped"])
    assert results[2]["restore"]["tier"] == "peer"


def test_corrupt_own_and_peer_copies_fall_back_to_the_persistent_tier(restored):
    for r in restored["corrupt-own-and-peer"][1]:
        assert r["ok"] and r["step"] == 4 and r["restore"]["tier"] == "persistent"
        assert r["restore"]["skipped"]
