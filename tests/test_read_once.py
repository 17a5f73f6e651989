"""Read-once restore: replicated targets are read from storage once across the job."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multiproc
import snapshard
from snapshard import ReadOptions
from snapshard.jax.read_once import leaf_plan

from conftest import mesh, sharded


def _restore(ckpt, n, d, layout, *extra, check=True, timeout=150):
    procs = multiproc.run(
        "read_once.py", n, d, "restore", ckpt, layout, *extra, timeout=timeout, check=check
    )
    return procs, [p.result() for p in procs]


def _restores(ckpt, n, d, *cases, timeout=150):
    """The restores `cases` (each the arguments of one after CKPT) one after the other in
    one job: {case: each process's result}; a process that never reported one: None."""
    procs = multiproc.run("read_once.py", n, d, "restores", ckpt, *cases, timeout=timeout)
    by_case = [{r["case"]: r for r in p.results} for p in procs]
    return {case: [got.get(case) for got in by_case] for case in cases}


def _totals(results):
    assert all(r is not None and r["ok"] for r in results), results
    unique = results[0]["unique"]
    read = sum(r["stats"]["bytes_read"] for r in results)
    peers = sum(r["stats"]["bytes_from_peers"] for r in results)
    return unique, read, peers


@pytest.fixture(scope="module")
def saved_4x2(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("once") / "ckpt"
    multiproc.run("read_once.py", 4, 2, "save", ckpt, timeout=120)
    return ckpt


@pytest.fixture(scope="module")
def restored_4x2(saved_4x2):
    """The restores of saved_4x2 on 4 x 2 that the tests below check, in one job."""
    return _restores(
        saved_4x2, 4, 2,
        "rep4", "rep4 --no-read-once", "rep2", "rep2 --no-read-once", "rep4 --default",
        "cols", "cols --no-read-once", "rep2 --budget 200000",
    )  # fmt: skip


# Beside the array leaves of the worker, every process reads all of the PRNG key and the
# NumPy leaf, and leaf 'odd' (7x5, no read sharding fits) is read by every holder.
_SMALL = 4 * (8 + 64 * 4 + 7 * 5 * 4) + 4 * 4096  # and a checksum block at most per process


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout,replicas", [("rep4", 4), ("rep2", 2)])
def test_replicated_state_is_read_once(restored_4x2, layout, replicas):
    on = restored_4x2[layout]
    unique, read, peers = _totals(on)
    assert read <= 1.05 * unique + _SMALL, (read, unique)
    assert peers > 0
    off = restored_4x2[f"{layout} --no-read-once"]
    unique, read_off, peers_off = _totals(off)
    assert peers_off == 0
    # Without read-once every holder reads its boxes: about replicas x unique.
    assert read_off >= 0.9 * replicas * unique, (read_off, unique)
    # Every byte a process holds was read by it or received: nothing is missing. (rep2 cuts
    # the saved columns finer: its processes read bands of whole rows, partly for others.)
    for r_on, r_off in zip(on, off, strict=True):
        got = r_on["stats"]["bytes_needed"] + r_on["stats"]["bytes_from_peers"]
        want = r_off["stats"]["bytes_needed"]
        assert got == want if layout == "rep4" else got >= want


@pytest.mark.multiprocess
def test_by_default_on_a_local_disk_every_holder_reads_its_boxes(saved_4x2, restored_4x2):
    """The default on a filesystem the mount table calls local: the processes plan the
    read-once, agree that it is off, and read as without it, bit-exact."""
    from snapshard.storage.mounts import is_network_filesystem

    if is_network_filesystem(saved_4x2):
        pytest.skip("the test directory is on a network filesystem: the default is on there")
    unique, read, peers = _totals(restored_4x2["rep4 --default"])
    assert peers == 0
    assert read >= 0.9 * 4 * unique, (read, unique)


@pytest.mark.multiprocess
def test_a_reshard_that_cuts_saved_rows_is_read_once(restored_4x2):
    """Columns cut finer than saved, each box on one process: without read-once each process
    reads whole checksum blocks, hence whole saved rows; with it, bands of whole rows are
    read once and exchanged."""
    on = restored_4x2["cols"]
    unique, read, peers = _totals(on)
    assert read <= 1.05 * unique + _SMALL, (read, unique)
    assert peers > 0
    off = restored_4x2["cols --no-read-once"]
    unique, read_off, peers_off = _totals(off)
    assert peers_off == 0 and read_off >= 1.8 * unique, (read_off, unique)
    for r_on, r_off in zip(on, off, strict=True):
        got = r_on["stats"]["bytes_needed"] + r_on["stats"]["bytes_from_peers"]
        assert got >= r_off["stats"]["bytes_needed"]


@pytest.mark.multiprocess
def test_small_memory_budget(restored_4x2):
    """Several batches, each agreed on before its collective, cut alike on every process."""
    unique, read, _ = _totals(restored_4x2["rep2 --budget 200000"])
    assert read <= 1.05 * unique + _SMALL, (read, unique)


@pytest.mark.multiprocess
def test_onto_another_process_count(saved_4x2):
    """Saved on 4 x 2, restored on 2 processes x 4 devices (each box on both processes)."""
    done = _restores(saved_4x2, 2, 4, "rep2", "rep2 --no-read-once")
    unique, read, _ = _totals(done["rep2"])
    assert read <= 1.05 * unique + _SMALL, (read, unique)
    assert _totals(done["rep2 --no-read-once"])[1] >= 1.8 * unique


@pytest.mark.multiprocess
def test_saved_on_2x4_restores_on_4x2(tmp_path):
    ckpt = tmp_path / "ckpt"
    multiproc.run("read_once.py", 2, 4, "save", ckpt, timeout=120)
    _, on = _restore(ckpt, 4, 2, "rep4")
    unique, read, _ = _totals(on)
    assert read <= 1.05 * unique + _SMALL, (read, unique)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "how,layout", [("--manager", "rep4"), ("--safetensors", "rep4"), ("--safetensors", "cols")]
)
def test_manager_and_safetensors(tmp_path, how, layout):
    ckpt = tmp_path / ("ckpt.safetensors" if how == "--safetensors" else "ckpt")
    multiproc.run("read_once.py", 4, 2, "save", ckpt, how, timeout=120)
    on, off = f"{layout} {how}", f"{layout} {how} --no-read-once"
    done = _restores(ckpt, 4, 2, on, *([off] if layout == "cols" else []))
    unique, read, peers = _totals(done[on])
    assert read <= 1.05 * unique + _SMALL, (read, unique)
    assert peers > 0
    if layout == "cols":  # whole saved rows per process without read-once
        assert _totals(done[off])[1] >= 2 * unique


@pytest.mark.multiprocess
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_reader_fails_every_process_naming_it(saved_4x2, failing):
    """Every process raises at once, naming the failing one, with one error class (process
    0's own failure too: an `except` written for one catches it on every process)."""
    t0 = time.monotonic()
    procs, results = _restore(
        saved_4x2, 4, 2, "rep4", "--fail-read", failing, "--timeout", 60, check=False,
        timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    for p, r in zip(procs, results, strict=True):
        assert p.returncode == 3, (p.process_id, p.stderr[-2000:])
        assert not r["ok"]
        assert f"process {failing} failed" in r["error"], r
        assert "injected read failure" in r["error"], r
        assert r["seconds"] < 30, r  # not the 60 s timeout: the failure is reported at once
    assert {r["error"].split(":")[0] for r in results} == {"StorageError"}, results
    assert elapsed < 100


def test_single_process_reads_each_byte_once_without_peers(ckpt):
    """Within one process read-once is a no-op: a box on several local devices is read once
    and copied device to device."""
    m = mesh(2, 4)
    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    snapshard.save(ckpt, {"x": sharded(x, m, "data", "model")})
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P()))}
    for read_once in (True, False):
        stats = snapshard.ReadStats()
        out = snapshard.load(ckpt, target, stats=stats, options=ReadOptions(read_once=read_once))
        assert stats.bytes_read <= 1.05 * x.nbytes and stats.bytes_from_peers == 0
        assert len(out["x"].addressable_shards) == 8
        for s in out["x"].addressable_shards:
            assert np.array_equal(np.asarray(s.data), x)


def test_read_sharding_of_a_replicated_target():
    """The planner's read sharding: the unused axes appended to the first axis they divide;
    nothing when no box is held by two processes (one process here) or nothing fits."""
    m = mesh(2, 4)
    # One process: no box has several holder processes, so nothing to gain.
    assert leaf_plan((64, 32), NamedSharding(m, P())) is None


def test_read_sharding_candidates():
    from snapshard.jax.read_once import _named_candidates

    m = mesh(2, 4)
    got = _named_candidates(NamedSharding(m, P(None, "model")), (64, 32))
    assert got[0].spec == P("data", "model")
    got = _named_candidates(NamedSharding(m, P()), (6, 16))
    assert got[0].spec == P(None, ("data", "model"))
    got = _named_candidates(NamedSharding(m, P("model")), (12, 5))
    assert got == []  # 12 is not divisible by 4 x 2, 5 by 2


def test_read_sharding_of_a_target_that_cuts_saved_rows():
    """With `bands` (the target cuts the saved rows), the read sharding cuts axis 0 over
    every device of the target's mesh; None where the rows do not divide."""
    m = mesh(2, 4)
    cols = NamedSharding(m, P(None, ("data", "model")))
    lp = leaf_plan((64, 32), cols, True)
    assert lp is not None and lp.read_sharding.spec == P(("data", "model"), None)
    assert lp.read_sharding.mesh == m
    assert leaf_plan((64, 32), cols, False) is None  # one holder per box, nothing to gain
    assert leaf_plan((6, 32), cols, True) is None  # 6 rows over 8 devices


def test_by_default_arrays_under_the_minimum_are_read_by_every_holder(monkeypatch):
    """read_once=None leaves out arrays of fewer than READ_ONCE_MIN_BYTES (moving one costs
    more than reading it again); read_once=True takes every array a read sharding fits."""
    from snapshard.format import ArrayLeaf
    from snapshard.jax import read_once
    from snapshard.reading import Request
    from snapshard.reading.read_once_policy import READ_ONCE_MIN_BYTES

    m = mesh(2, 4)
    target = NamedSharding(m, P())
    # (one process here: a leaf plan as two processes would have it)
    monkeypatch.setattr(
        read_once, "leaf_plan", lambda shape, s, cuts: read_once.LeafPlan(s, (8, 8), (4, 4), (4, 4))
    )
    side = int(np.sqrt(READ_ONCE_MIN_BYTES // 4))
    reqs = [
        Request(
            ArrayLeaf(("small",), "array", "float32", (4, 16)), "jax", np.dtype(np.float32), target
        ),
        Request(
            ArrayLeaf(("large",), "array", "float32", (side, side)),
            "jax",
            np.dtype(np.float32),
            target,
        ),
    ]
    assert sorted(read_once.plan(reqs, 0, 2, None, read_once=None)) == [1]
    assert sorted(read_once.plan(reqs, 0, 2, None, read_once=True)) == [0, 1]
    # The bytes as saved count, not the target's: a float32 array of just the minimum
    # restored as float16 is still read once.
    cast = Request(
        ArrayLeaf(("cast",), "array", "float32", (side, side)), "jax", np.dtype(np.float16), target
    )
    assert sorted(read_once.plan([cast], 0, 2, None, read_once=None)) == [0]
