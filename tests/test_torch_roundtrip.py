"""snapshard.torch in one process: dtypes, in-place loads, casts, partial restores, async
staging, and the store coordinator's timeouts."""

from __future__ import annotations

import threading
from datetime import timedelta

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import snapshard  # noqa: E402
import snapshard.torch as st  # noqa: E402
from snapshard import ReadOptions  # noqa: E402
from snapshard.coordination.rendezvous import Rendezvous  # noqa: E402
from snapshard.errors import CoordinationError, TargetMismatchError  # noqa: E402
from snapshard.torch.dtypes import TO_NUMPY, from_numpy, host_view  # noqa: E402

DTYPES = list(TO_NUMPY)


def _random(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def _bits(t):
    return host_view(t.contiguous()).view(np.uint8).tobytes()


def test_host_views_share_memory_for_every_dtype():
    for dt in DTYPES:
        t = _random(dt, (3, 4))
        v = host_view(t)
        assert v.dtype == TO_NUMPY[dt]
        assert v.ctypes.data == t.data_ptr()
        back = from_numpy(v)
        assert back.dtype == dt and back.data_ptr() == t.data_ptr()
    assert np.dtype(ml_dtypes.bfloat16) == TO_NUMPY[torch.bfloat16]


def test_every_dtype_round_trips_bit_exact(tmp_path):
    state = {str(dt).removeprefix("torch."): _random(dt, (5, 3), i) for i, dt in enumerate(DTYPES)}
    st.save(tmp_path / "c", state)
    out = st.load(tmp_path / "c")
    for k, v in state.items():
        assert out[k].dtype == v.dtype and _bits(out[k]) == _bits(v), k
    target = {k: torch.empty_like(v) for k, v in state.items()}
    got = st.load(tmp_path / "c", target)
    assert got is target
    for k, v in state.items():
        assert _bits(target[k]) == _bits(v), k


def test_state_dict_values_containers_and_in_place_fill(tmp_path):
    w = torch.randn(6, 4)
    state = {
        "model": {"w": w, "b": torch.randn(4).to(torch.bfloat16), "empty": torch.zeros(0, 3)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, 4)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "fused": None}],
        },
        "epoch": 7,
    }
    st.save(tmp_path / "c", state)
    wt = torch.zeros(6, 4)
    target = {
        "model": {"w": wt, "b": torch.zeros(4)},  # bfloat16 saved, float32 asked: cast
        "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": [9], "fused": 1}]},
        "epoch": 0,
    }
    out = st.load(tmp_path / "c", target)
    assert out is target and out["model"]["w"] is wt
    assert torch.equal(wt, w)
    assert torch.equal(target["model"]["b"], state["model"]["b"].float())
    assert target["optim"]["param_groups"] == [
        {"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "fused": None}
    ]
    assert target["epoch"] == 7
    meta = st.metadata(tmp_path / "c")
    assert meta["model"]["w"].shape == (6, 4)
    assert meta["model"]["w"].sharding["type"] == "torch.Tensor"


def test_partial_restore_reads_only_the_target_entries(tmp_path):
    state = {"big": torch.randn(256, 256), "small": torch.randn(8)}
    st.save(tmp_path / "c", state)
    stats = snapshard.ReadStats()
    target = {"small": torch.zeros(8)}
    st.load(tmp_path / "c", target, stats=stats)
    assert torch.equal(target["small"], state["small"])
    assert stats.bytes_needed == 8 * 4 and stats.bytes_read < 64 << 10


def test_strided_target_regions_and_numpy_targets(tmp_path):
    state = {"a": torch.arange(24, dtype=torch.float32).reshape(4, 6), "n": np.arange(5)}
    st.save(tmp_path / "c", state)
    base = torch.zeros(6, 4)
    target = {"a": base.t(), "n": np.zeros(5, np.int64)}  # a non-contiguous view
    st.load(tmp_path / "c", target)
    assert torch.equal(base.t(), state["a"])
    assert np.array_equal(target["n"], state["n"])


def test_a_small_memory_budget_reads_in_batches_and_holds_one_batch_of_staging(
    tmp_path, monkeypatch
):
    import weakref

    import snapshard.torch.target_fills as target_fills

    state = {f"w{i}": torch.randn(16, 16) for i in range(5)}  # 1 KiB each
    st.save(tmp_path / "c", state)
    live, peak, made = [0], [0], [0]
    real = target_fills.aligned_empty

    def counted(nbytes):  # the staging buffers alive at once
        buf = real(nbytes)
        live[0] += nbytes
        made[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(buf.base, lambda: live.__setitem__(0, live[0] - nbytes))
        return buf

    monkeypatch.setattr(target_fills, "aligned_empty", counted)
    target = {k: torch.zeros(16, 16, dtype=torch.float64) for k in state}  # cast: buffered
    st.load(tmp_path / "c", target, options=ReadOptions(memory_budget=2048))
    for k, v in state.items():
        assert torch.equal(target[k], v.double())
    assert made[0] == 5
    assert peak[0] == 2048  # two leaves per batch, each batch's staging dropped after it


def test_many_small_tensors_are_read_a_bounded_number_at_a_time(tmp_path, monkeypatch):
    """However many tensors a state has, a batch reads at most BATCH_ITEMS regions (what
    each holds besides its bytes stays bounded), also without a memory budget."""
    import snapshard.reading.fills as fills
    import snapshard.torch.load_reads as load_reads

    state = {f"w{i}": torch.randn(4, 4) for i in range(11)}
    st.save(tmp_path / "c", state)
    sizes = []
    real = fills.batches

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        sizes.extend(len(b) for b in out)
        return out

    monkeypatch.setattr(load_reads, "BATCH_ITEMS", 3)
    monkeypatch.setattr(fills, "batches", recorded)
    target = {k: torch.zeros(4, 4) for k in state}
    st.load(tmp_path / "c", target)
    assert sizes == [3, 3, 3, 2]
    for k, v in state.items():
        assert torch.equal(target[k], v)


def test_target_mismatches_are_named(tmp_path):
    st.save(tmp_path / "c", {"w": torch.zeros(3, 2), "k": 1})
    with pytest.raises(TargetMismatchError, match="shape"):
        st.load(tmp_path / "c", {"w": torch.zeros(2, 3)})
    with pytest.raises(TargetMismatchError, match="not in the checkpoint"):
        st.load(tmp_path / "c", {"v": torch.zeros(3, 2)})
    with pytest.raises(TargetMismatchError, match="value"):
        st.load(tmp_path / "c", {"k": torch.zeros(1)})


def test_async_save_snapshots_before_returning_and_reuses_buffers(tmp_path):
    w = torch.randn(64, 64)
    before = w.clone()
    job = st.save_async(tmp_path / "a", {"w": w})
    w.add_(1.0)  # what optimizer.step() does
    t = job.wait()
    assert t.bytes_staged == w.nbytes
    assert torch.equal(st.load(tmp_path / "a")["w"], before)
    pool = st.saving._buffers
    cached = pool.cached_bytes()
    assert cached == w.nbytes
    ptrs = {b[0].ctypes.data for v in pool._free.values() for b in v}
    adapter = st.saving.TorchAdapter(pool)
    adapter._buffer(w.nbytes, False)
    assert adapter.taken[0][0].ctypes.data in ptrs  # the same host buffer, not a new one
    pool.give_back(adapter.taken)
    job = st.save_async(tmp_path / "b", {"w": w})
    w.zero_()
    job.wait()
    assert torch.equal(st.load(tmp_path / "b")["w"], before + 1.0)


def test_manager_with_torch_state_async_retention_and_in_place_restore(tmp_path):
    w = torch.zeros(8, 4)
    with st.CheckpointManager(tmp_path, save_interval_steps=3, max_to_keep=2) as mgr:
        for step in range(10):
            w.add_(1.0)  # in place while the previous step's save may still write
            mgr.save(step, {"w": w, "step": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [6, 9]
    target = {"w": torch.full((8, 4), -1.0), "step": -1}
    with st.CheckpointManager(tmp_path) as mgr:
        out = mgr.restore(6, target)
    assert out is target and out["step"] == 6 and torch.equal(target["w"], torch.full((8, 4), 7.0))
    # the same steps as the JAX manager's: it reads them too
    with snapshard.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [6, 9]
        assert np.array_equal(mgr.restore()["w"], np.full((8, 4), 10.0, np.float32))


def test_manager_with_torch_state_raises_a_background_failure_naming_the_step(
    tmp_path, monkeypatch
):
    from snapshard import saving

    real = saving.finish
    calls = []

    def failing(prep):
        calls.append(prep)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(prep)

    monkeypatch.setattr(saving, "finish", failing)
    mgr = st.CheckpointManager(tmp_path)
    w = torch.ones(16)
    mgr.save(1, {"w": w})
    mgr.save(2, {"w": w})
    with pytest.raises(snapshard.BackgroundSaveError, match="step 2 failed: OSError: disk full"):
        mgr.save(3, {"w": w})
    mgr.save(4, {"w": w})  # raised once; the manager goes on
    mgr.close()
    assert mgr.all_steps() == [1, 4]
    assert mgr._pools.cached_bytes() == 0  # the manager's buffers, released by close


def test_manager_with_torch_state_saves_incrementally(tmp_path):
    frozen, trained = torch.randn(256, 64), torch.randn(256, 64)
    with st.CheckpointManager(tmp_path, incremental=True, max_to_keep=2) as mgr:
        for step in range(4):
            trained.add_(1.0)
            mgr.save(step, {"frozen": frozen, "trained": trained})
        mgr.wait_until_finished()
        written = {s: t.bytes_written for s, t in mgr.save_timings().items()}
        # after the first step only the tensor that changed is written again
        assert written[0] == 2 * trained.nbytes
        assert all(written[s] == trained.nbytes for s in (1, 2, 3))
        target = {"frozen": torch.zeros(256, 64), "trained": torch.zeros(256, 64)}
        mgr.restore(None, target)
    assert torch.equal(target["frozen"], frozen) and torch.equal(target["trained"], trained)


def test_dcp_checkpoint_converts_in_one_process(tmp_path, capsys):
    import warnings

    import torch.distributed.checkpoint as dcp

    from snapshard.cli import main

    big = torch.randn(300, 40)
    state = {
        "model": {"w": big, "half": torch.arange(5, dtype=torch.bfloat16)},
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "names": ["w", "half"]}],
        "step": 7,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    dst = tmp_path / "out"
    assert main(["convert", str(tmp_path / "dcp"), str(dst), "--to", "safetensors"]) == 2
    assert "converts to snapshard only" in capsys.readouterr().err
    with pytest.raises(st.dcp.PickleRefusedError, match="pickle"):
        st.dcp.convert_dcp(str(tmp_path / "dcp"), dst)
    # small pieces: the 48000-byte tensor is written as chunks of 50 rows (8000 bytes)
    manifest = st.convert_dcp(str(tmp_path / "dcp"), dst, trust_pickle=True, chunk_bytes=8000)
    chunks = {leaf.name: leaf.chunks for leaf in manifest.arrays}
    assert len(chunks["model/w"]) == 6 and set(chunks["model/w"].nbytes) == {8000}
    assert len(chunks["empty"]) == 0
    out = st.load(dst)
    assert _bits(out["model"]["w"]) == _bits(big)
    assert out["model"]["half"].dtype == torch.bfloat16
    assert torch.equal(out["model"]["half"], state["model"]["half"])
    assert out["scalar"].shape == () and out["scalar"].item() == 3.5
    assert out["empty"].shape == (0, 4)
    assert out["groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "names": ["w", "half"]}]
    assert out["step"] == 7


def test_the_jax_manager_points_torch_state_to_the_torch_one(tmp_path):
    with snapshard.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(snapshard.UnsupportedLeafError, match=r"snapshard\.torch \(save"):
            mgr.save(0, {"w": torch.ones(3)})
        assert mgr.all_steps() == []


def test_manager_refuses_the_local_tier_for_torch_state(tmp_path):
    from snapshard.manager import LocalTier

    # The node-local tier is JAX's: the torch manager has no such keyword.
    with pytest.raises(TypeError, match="local_tier"):
        st.CheckpointManager(tmp_path, local_tier=LocalTier(str(tmp_path / "local")))  # type: ignore[call-arg]


def _store_coords(n, timeout=30):
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout))
    return [st.TorchStoreCoordinator(store, rank=r, world_size=n) for r in range(n)]


def test_store_coordinator_get_set_and_timeouts():
    c0, c1, _c2 = _store_coords(3)
    assert c0.try_get("x") is None
    threading.Timer(0.05, lambda: c1.set("x", "hello")).start()
    assert c0.get("x", 5) == "hello"
    with pytest.raises(TimeoutError, match="not set within"):
        c0.get("y", 0.05)


def test_store_coordinator_barrier_names_missing_ranks():
    coords = _store_coords(3)
    threads = [threading.Thread(target=c.barrier, args=("b", 5)) for c in coords[1:]]
    for t in threads:
        t.start()
    coords[0].barrier("b", 5)
    for t in threads:
        t.join()
    # The second barrier of the same name: rank 2 never comes.
    errors = []

    def rank1() -> None:
        try:
            coords[1].barrier("b", 0.3)
        except CoordinationError as e:
            errors.append(str(e))

    t1 = threading.Thread(target=rank1)
    t1.start()
    with pytest.raises(CoordinationError, match=r"rank\(s\) \[2\] did not arrive"):
        coords[0].barrier("b", 0.2)
    t1.join()
    assert errors and "[2]" in errors[0]


def test_rendezvous_over_the_store_names_ranks_that_did_not_report():
    coords = _store_coords(4)
    rv = [Rendezvous(c, "snapshard/save/test/0", "save to somewhere", 0.2) for c in coords]
    rv[1].report("written/1", index="p1.json")
    rv[3].report("written/3", index="p3.json")
    rv[0].start_clock()
    with pytest.raises(CoordinationError, match=r"process\(es\) \[2\] did not report"):
        rv[0].gather("written")


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="NO CUDA DEVICE: the pinned-buffer, side-stream staging path is not exercised here",
)
def test_cuda_tensors_stage_through_pinned_buffers(tmp_path):
    w = torch.randn(256, 256, device="cuda")
    before = w.cpu()
    job = st.save_async(tmp_path / "a", {"w": w})
    w.add_(1.0)  # queued on the current stream after the blocking phase returned
    job.wait()
    assert torch.equal(st.load(tmp_path / "a")["w"], before)
    target = {"w": torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)}
    st.load(tmp_path / "a", target)
    assert torch.equal(target["w"].cpu(), before.to(torch.bfloat16))
