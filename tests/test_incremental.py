"""Incremental saves: references to a base checkpoint's chunks, retention that keeps what kept
steps refer to, verify and convert across references, crashes during saves and retention."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import snapshard
from s3env import fresh_prefix, store_params
from snapshard import CheckpointManager, SaveOptions
from snapshard.cli import main as cli_main
from snapshard.errors import SnapshardError
from snapshard.format import records as rec
from snapshard.saving import incremental

WORKERS = Path(__file__).parent / "workers"


def frozen_tree():
    rng = np.random.default_rng(0)
    return {
        "frozen": {
            "emb": rng.standard_normal((256, 64)).astype(np.float32),
            "w": rng.integers(0, 1 << 30, (64, 1000), dtype=np.int64),
        }
    }


def tree(step: int):
    t = frozen_tree()
    t["adapter"] = np.full((32, 8), step, np.float32)
    t["step"] = step
    return t


def steps_on_disk(directory) -> list[str]:
    """The checkpoints in a directory (not the manager's writer lease and other dot files)."""
    return sorted(p.name for p in Path(directory).iterdir() if not p.name.startswith("."))


def manifest(path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_bytes())


def assert_same(out, expected):
    flat_o = jax.tree_util.tree_leaves_with_path(out)
    flat_e = jax.tree_util.tree_leaves_with_path(expected)
    assert [p for p, _ in flat_o] == [p for p, _ in flat_e]
    for (p, a), (_, b) in zip(flat_o, flat_e, strict=True):
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), p
        else:
            assert a == b, p


def test_save_with_base_refers_to_unchanged_chunks(tmp_path):
    snapshard.save(tmp_path / "1", tree(1), options=SaveOptions(hashes=True))
    t = snapshard.save(tmp_path / "2", tree(2), base=tmp_path / "1")
    assert t.bytes_written == 32 * 8 * 4  # only the adapter
    t = snapshard.save(tmp_path / "3", tree(3), base=tmp_path / "2")
    assert t.bytes_written == 32 * 8 * 4
    refs = [r for r in manifest(tmp_path / "3")["refs"] if r]
    # resolved to the checkpoint holding the bytes: never a chain through step 2
    assert {r["checkpoint"] for r in refs} == {"1"}
    assert_same(snapshard.load(tmp_path / "3"), tree(3))
    # the record file carries its content hashes
    idx = next((tmp_path / "3" / "index").iterdir()).read_bytes()
    assert rec.header_flags(idx) & rec.FILE_HASHES
    # step 2 can go: 3 needs only files of 1
    snapshard.storage.storage_for(tmp_path / "2").delete()
    assert_same(snapshard.load(tmp_path / "3"), tree(3))


def test_changed_bytes_are_written_and_partial_restores_cross_references(tmp_path):
    snapshard.save(tmp_path / "a", tree(1), options=SaveOptions(hashes=True))
    t2 = tree(2)
    t2["frozen"]["emb"] = t2["frozen"]["emb"].copy()
    t2["frozen"]["emb"][100, 3] += 1.0  # one element: the hash differs
    t = snapshard.save(tmp_path / "b", t2, base=tmp_path / "a")
    assert t.bytes_written == 256 * 64 * 4 + 32 * 8 * 4
    assert_same(snapshard.load(tmp_path / "b"), t2)
    part = snapshard.load(
        tmp_path / "b", {"frozen": {"w": jax.ShapeDtypeStruct((64, 1000), np.int64)}}
    )
    assert np.array_equal(part["frozen"]["w"], t2["frozen"]["w"])


def test_base_without_hashes_refers_to_nothing_and_says_so(tmp_path):
    from snapshard.saving.incremental import UnprovableBaseWarning

    snapshard.save(tmp_path / "a", tree(1))
    with pytest.warns(UnprovableBaseWarning, match=r"no xxh3-128 content hashes for \d+ bytes"):
        t = snapshard.save(tmp_path / "b", tree(1), base=tmp_path / "a")
    assert t.bytes_written == sum(
        x.nbytes for x in jax.tree_util.tree_leaves(tree(1)) if isinstance(x, np.ndarray)
    )
    assert not [r for r in manifest(tmp_path / "b")["refs"] if r]
    with warnings.catch_warnings():  # a base with hashes: nothing to warn of
        warnings.simplefilter("error", UnprovableBaseWarning)
        t = snapshard.save(tmp_path / "c", tree(1), base=tmp_path / "b")
    assert t.bytes_written == 0


def test_other_shape_or_dtype_is_never_referred_to(tmp_path):
    snapshard.save(
        tmp_path / "a", {"x": np.zeros((8, 8), np.float32)}, options=SaveOptions(hashes=True)
    )
    t = snapshard.save(tmp_path / "b", {"x": np.zeros((8, 8), np.int32)}, base=tmp_path / "a")
    assert t.bytes_written == 256
    t = snapshard.save(tmp_path / "c", {"x": np.zeros((4, 16), np.float32)}, base=tmp_path / "a")
    assert t.bytes_written == 256


def test_base_must_be_a_sibling(tmp_path):
    (tmp_path / "x").mkdir()
    snapshard.save(tmp_path / "x" / "a", tree(1), options=SaveOptions(hashes=True))
    with pytest.raises(ValueError, match="beside it"):
        snapshard.save(tmp_path / "b", tree(1), base=tmp_path / "x" / "a")
    with pytest.raises(ValueError, match=r"x/a/ is itself"):
        snapshard.save(tmp_path / "x" / "a", tree(1), base=f"{tmp_path}/x/a/", overwrite=True)
    snapshard.save(tmp_path / "x" / "a+b", tree(1), options=SaveOptions(hashes=True))
    with pytest.raises(ValueError, match=r"a\+b: .* letters, digits"):  # not "corrupt"
        snapshard.save(tmp_path / "x" / "c", tree(1), base=tmp_path / "x" / "a+b")


def test_sharded_jax_arrays_refer_box_by_box(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b"))
    x = jax.device_put(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), sh)
    snapshard.save(tmp_path / "1", {"x": x}, options=SaveOptions(hashes=True))
    y = x.at[0, 0].set(-1.0)  # one of four boxes changes
    t = snapshard.save(tmp_path / "2", {"x": y}, base=tmp_path / "1")
    assert t.bytes_written == 32 * 32 * 4
    target = {"x": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=sh)}
    out = snapshard.load(tmp_path / "2", target)
    assert np.array_equal(np.asarray(out["x"]), np.asarray(y))
    # onto another sharding: each box gathers pieces of both checkpoints
    sh2 = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "a"))
    out = snapshard.load(
        tmp_path / "2", {"x": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=sh2)}
    )
    assert np.array_equal(np.asarray(out["x"]), np.asarray(y))


def test_manager_chain_of_5_under_max_to_keep_2(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=2, incremental=True) as m:
        for step in range(1, 6):
            m.save(step, tree(step))
            m.wait_until_finished()
            for s in m.all_steps():
                assert_same(m.restore(s), tree(s))
        assert m.all_steps() == [4, 5]
        persisted = m.tier_reports()[5].persistent_bytes
        assert persisted == 32 * 8 * 4
    # step 1 holds the frozen bytes: retained for references, hidden, trimmed
    assert (tmp_path / "1" / "RETAINED").is_file()
    assert not (tmp_path / "1" / "index").exists() or not any((tmp_path / "1" / "index").iterdir())
    assert steps_on_disk(tmp_path) == ["1", "4", "5"]
    with CheckpointManager(tmp_path, max_to_keep=2, incremental=True) as m:
        assert m.all_steps() == [4, 5]
        for s in (4, 5):
            assert_same(m.restore(s), tree(s))
        for step in (6, 7):
            m.save(step, tree(step))
        m.wait_until_finished()
        assert m.all_steps() == [6, 7]
        for s in (6, 7):
            assert_same(m.restore(s), tree(s))
    assert steps_on_disk(tmp_path) == ["1", "6", "7"]


def test_a_resumed_run_revisits_retained_steps_whose_own_bases_are_gone(tmp_path):
    """Steps held only for references may refer to steps deleted since: a new manager
    (a resumed job) revisits them at its first retention without reading those bases."""

    def state(step: int) -> dict:  # "big" changes every 3rd step, "c" every 4th
        big = np.arange(1 << 14, dtype=np.float32) + step // 3
        return {"big": big, "c": np.full((64, 64), step // 4, np.float32)}

    with CheckpointManager(tmp_path, max_to_keep=3, incremental=True, async_save=False) as m:
        for step in range(1, 13):
            m.save(step, state(step))
    retained = [s for s in steps_on_disk(tmp_path) if (tmp_path / s / "RETAINED").is_file()]
    assert retained  # (what the resumed job revisits)
    with CheckpointManager(tmp_path, max_to_keep=3, incremental=True, async_save=False) as m:
        for step in range(13, 16):
            m.save(step, state(step))
        assert m.all_steps() == [13, 14, 15]
        for step in m.all_steps():
            assert_same(m.restore(step), state(step))


@pytest.mark.parametrize("gone", ["base", "its base"])
def test_a_base_deleted_by_hand_fails_one_save_and_the_next_writes_whole(tmp_path, gone):
    """The newest step (the next save's base) deleted by hand, or the step it refers to (a
    resumed run): the save that met it fails naming it, and the one after writes whole,
    then refers to itself again, instead of failing at every save from then on."""
    import shutil

    first = CheckpointManager(tmp_path, incremental=True)
    for step in (1, 2):
        first.save(step, tree(step))
    first.wait_until_finished()
    if gone == "its base":  # a resumed run: the newest step refers to step 1
        first.close()
        shutil.rmtree(tmp_path / "1")
    else:  # the running manager's newest step
        shutil.rmtree(tmp_path / "2")
    with first if gone == "base" else CheckpointManager(tmp_path, incremental=True) as m:
        m.save(3, tree(3))
        with pytest.raises(snapshard.BackgroundSaveError, match=r"step 3.*(no checkpoint|'1')"):
            m.wait_until_finished()
        for step in (4, 5):
            m.save(step, tree(step))
        m.wait_until_finished()
        assert m.tier_reports()[4].persistent_bytes > m.tier_reports()[5].persistent_bytes
        for step in (4, 5):
            assert_same(m.restore(step), tree(step))


def test_a_referenced_data_file_gone_is_named_with_the_leaf_read_from_it(tmp_path):
    snapshard.save(tmp_path / "a", tree(1), options=SaveOptions(hashes=True))
    changed = tree(1)
    changed["frozen"]["w"] = changed["frozen"]["w"] + 1
    snapshard.save(tmp_path / "b", changed, base=tmp_path / "a")
    for f in (tmp_path / "a" / "data").iterdir():
        f.unlink()
    with pytest.raises(snapshard.CorruptCheckpointError, match=r"is missing \(reading leaf '"):
        snapshard.load(tmp_path / "b")


def test_retained_step_is_deleted_once_nothing_refers_to_it(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=1, incremental=True) as m:
        m.save(1, {"a": np.ones(1000, np.float32)})
        m.save(2, {"a": np.ones(1000, np.float32)})
        m.wait_until_finished()
        assert steps_on_disk(tmp_path) == ["1", "2"]
        m.save(3, {"a": np.zeros(1000, np.float32)})  # nothing refers to step 1 now
        m.wait_until_finished()
        assert_same(m.restore(3), {"a": np.zeros(1000, np.float32)})
    assert steps_on_disk(tmp_path) == ["3"]


def test_a_retained_step_whose_referrers_were_deleted_by_hand_frees_its_number(tmp_path):
    """Every kept step deleted by hand leaves a step retained for their references that no
    step needs: a new writer removes it, and a save of that step number works (it failed
    in the background with advice the manager cannot follow: pass overwrite=True)."""
    with CheckpointManager(tmp_path, max_to_keep=1, incremental=True) as m:
        m.save(1, {"a": np.ones(1000, np.float32)})
        m.save(2, {"a": np.ones(1000, np.float32)})
        m.wait_until_finished()
    assert (tmp_path / "1" / "RETAINED").exists()
    shutil.rmtree(tmp_path / "2")
    with CheckpointManager(tmp_path, max_to_keep=1, incremental=True) as m:
        assert m.all_steps() == []
        m.save(1, {"a": np.full(1000, 7, np.float32)})
        m.wait_until_finished()
        assert_same(m.restore(1), {"a": np.full(1000, 7, np.float32)})
    assert steps_on_disk(tmp_path) == ["1"] and not (tmp_path / "1" / "RETAINED").exists()


def test_identity_shortcut_skips_hashing_the_same_jax_array(tmp_path, monkeypatch):
    frozen = jnp.arange(4096, dtype=jnp.float32)
    hashed: list[int] = []
    real = incremental.chunk_hash

    def counting(raw, hid=None):
        hashed.append(len(raw))
        return real(raw, hid)

    monkeypatch.setattr(incremental, "chunk_hash", counting)
    threads = SaveOptions(background="thread")  # the hashes counted are this process's
    with CheckpointManager(tmp_path, incremental=True, save_options=threads) as m:
        m.save(1, {"frozen": frozen, "t": jnp.zeros(16)})
        m.wait_until_finished()
        assert sum(hashed) == 4096 * 4 + 16 * 4
        hashed.clear()
        m.save(2, {"frozen": frozen, "t": jnp.ones(16)})
        m.wait_until_finished()
        assert hashed == [16 * 4]  # the frozen array: identical object, not hashed
        assert m.tier_reports()[2].persistent_bytes == 16 * 4
        # an equal but new array is hashed, and still referred to
        hashed.clear()
        m.save(3, {"frozen": frozen + 0, "t": jnp.ones(16)})
        m.wait_until_finished()
        assert sum(hashed) == 4096 * 4 + 16 * 4
        assert m.tier_reports()[3].persistent_bytes == 0
        out = m.restore(3)
        assert np.array_equal(out["frozen"], np.asarray(frozen))


def test_verify_checks_referenced_files_and_convert_materialises(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root, incremental=True) as m:
        for step in (1, 2):
            m.save(step, tree(step))
    assert cli_main(["verify", str(root / "2")]) == 0
    dst = tmp_path / "copy"
    assert cli_main(["convert", str(root / "2"), str(dst)]) == 0
    assert not [r for r in manifest(dst)["refs"] if r]
    # corrupt a byte of step 1's data that step 2 refers to: verify of step 2 fails
    data = sorted((root / "1" / "data").iterdir(), key=lambda p: -p.stat().st_size)[0]
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert cli_main(["verify", str(root / "2")]) != 0
    assert "checksum" in capsys.readouterr().out.lower()
    with pytest.raises(SnapshardError):
        snapshard.load(root / "2")
    # the copy stands alone
    import shutil

    shutil.rmtree(root)
    assert_same(snapshard.load(dst), tree(2))


def run_worker(directory, *args, timeout=120):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKERS), *sys.path])}
    return subprocess.run(
        [sys.executable, str(WORKERS / "incremental_kill.py"), str(directory), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def check_every_committed_step(directory):
    """Every step a fresh manager lists loads bit-exactly; returns them."""
    with CheckpointManager(directory, max_to_keep=2, incremental=True) as m:
        steps = m.all_steps()
        for s in steps:
            assert_same(m.restore(s), tree(s))
    return steps


@pytest.mark.parametrize(
    "point,at", [("write", 3), ("write", 4), ("commit", 4), ("retention", 1), ("retention", 2)]
)
def test_kill_9_during_incremental_save_or_retention(tmp_path, point, at):
    r = run_worker(tmp_path, point, str(at))
    assert r.returncode == -9, r.stdout + r.stderr
    steps = check_every_committed_step(tmp_path)
    assert steps, "some step was committed before the kill"
    # the run resumes, and retention cleans up after the crash
    r = run_worker(tmp_path, "none", "0", "6", "9")
    assert r.returncode == 0, r.stdout + r.stderr
    assert check_every_committed_step(tmp_path) == [8, 9]


@pytest.fixture(params=["memory", *store_params()])
def store_root(request):
    import uuid

    if request.param == "memory":
        return f"memory://incr-{uuid.uuid4().hex[:8]}/run"
    return f"{fresh_prefix(request, request.param)}/run"


def test_object_store_chain_under_retention(store_root):
    from snapshard.storage import root_for

    with CheckpointManager(store_root, max_to_keep=2, incremental=True) as m:
        for step in range(1, 6):
            m.save(step, tree(step))
        m.wait_until_finished()
        assert m.all_steps() == [4, 5]
        for s in (4, 5):
            assert_same(m.restore(s), tree(s))
        assert m.tier_reports()[5].persistent_bytes == 32 * 8 * 4
    root = root_for(store_root)
    assert sorted(root.list()) == ["1", "4", "5"]  # 1: retained for references
    with CheckpointManager(store_root, max_to_keep=2, incremental=True) as m:
        assert m.all_steps() == [4, 5]
        assert_same(snapshard.load(f"{store_root}/5"), tree(5))
    # overwriting a step never deletes the files it referred to
    snapshard.save(f"{store_root}/5", tree(5), overwrite=True)
    assert_same(snapshard.load(f"{store_root}/4"), tree(4))


def test_a_plain_manager_never_deletes_what_kept_steps_refer_to(tmp_path):
    with CheckpointManager(tmp_path, incremental=True) as m:
        for step in (1, 2):
            m.save(step, tree(step))
    with CheckpointManager(tmp_path, max_to_keep=2) as m:  # not incremental
        m.save(3, tree(3))  # a full save; step 1 is dropped, but step 2 refers to it
        m.wait_until_finished()
        assert m.all_steps() == [2, 3]
        assert_same(m.restore(2), tree(2))
        assert (tmp_path / "1" / "RETAINED").is_file()
        m.save(4, tree(4))  # step 2 dropped: nothing refers to step 1 any more
        m.wait_until_finished()
        assert_same(m.restore(3), tree(3))
    assert steps_on_disk(tmp_path) == ["3", "4"]


def test_ls_shows_retained_steps_and_verify_skips_unused_slots(tmp_path, capsys):
    from snapshard.cli.ls import list_checkpoints

    with CheckpointManager(tmp_path, max_to_keep=1, incremental=True) as m:
        for step in (1, 2, 3):
            m.save(step, tree(step))
    states = {e["name"]: e["state"] for e in list_checkpoints(str(tmp_path))["checkpoints"]}
    assert states == {"1": "retained", "3": "complete"}
    assert cli_main(["verify", str(tmp_path / "3")]) == 0
    # a retained step is said to be one, not read as a damaged checkpoint
    kept_only = r"kept only for the files later steps refer to"
    with pytest.raises(snapshard.CheckpointNotFoundError, match=kept_only):
        snapshard.load(tmp_path / "1")
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path / "1")]) == 2
    assert re.search(kept_only, capsys.readouterr().err)
    assert cli_main(["info", str(tmp_path / "1")]) == 0
    assert "retained for later steps' references, not restorable" in capsys.readouterr().out
    # a slot no chunk uses is null: w (file 0 of 4, alone) changes, emb (file 1) does not
    t = tree(5)
    t["frozen"]["w"] = t["frozen"]["w"] + 1
    snapshard.save(tmp_path / "x4", tree(4), options=SaveOptions(hashes=True))
    snapshard.save(tmp_path / "x5", t, base=tmp_path / "x4")
    refs = manifest(tmp_path / "x5")["refs"]
    assert refs[0] is None and refs[1]["checkpoint"] == "x4"
    assert cli_main(["verify", str(tmp_path / "x5")]) == 0
    assert_same(snapshard.load(tmp_path / "x5"), t)


def test_compressed_incremental_round_trip_on_object_stores(store_root):
    s = tree(1)
    snapshard.save(f"{store_root}/1", s, options=SaveOptions(hashes=True, compression="zstd"))
    t = snapshard.save(
        f"{store_root}/2", tree(2), base=f"{store_root}/1", options=SaveOptions(compression="zstd")
    )
    assert t.bytes_written == 32 * 8 * 4
    assert_same(snapshard.load(f"{store_root}/2"), tree(2))
    part = snapshard.load(
        f"{store_root}/2", {"frozen": {"emb": jax.ShapeDtypeStruct((256, 64), np.float32)}}
    )
    assert np.array_equal(part["frozen"]["emb"], s["frozen"]["emb"])
