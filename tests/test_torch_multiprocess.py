"""snapshard.torch across real processes: FSDP2 and FSDP2 x TP state saved on one world size
and loaded onto another, bit-exact (gloo on CPU; each run bounded in time)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

import multiproc

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}  # a PyTorch-only install


def _run(cmd: str, n: int, root) -> list:
    return multiproc.run("torch_job.py", n, 1, cmd, str(root), timeout=150, env=ENV)


def _check(saved: dict, loaded: list, names: list[str], kinds: list[str]) -> None:
    for p in loaded:
        got = p.result()
        for name in names:
            want = saved[name.removesuffix("-async")]
            for kind in kinds:
                assert got[f"{name}@{kind}"] == want, (p.process_id, name, kind)


def test_fsdp_and_tp_state_from_4_ranks_onto_2(tmp_path):
    ranks = _run("save", 4, tmp_path)
    saved = ranks[0].result()
    # Every rank computed the same write plan, each on its own.
    for kind in ("1d", "2d"):
        assert len({p.result()[f"{kind}-plan"] for p in ranks}) == 1
    # The 2-D mesh gives every placement FSDP2 and TP make, strided sharding included.
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in saved["placements"]
    assert "(Shard(dim=0), Shard(dim=1))" in saved["placements"]
    # The async save returned before the optimizer stepped again: the checkpoint holds the
    # state from before that step.
    assert saved["1d"] != saved["1d-after"]
    assert saved["1d"]["strided"] == saved["1d-after"]["strided"]
    loaded = _run("load", 2, tmp_path)
    _check(saved, loaded, ["1d", "1d-async", "2d", "2d-async"], ["1d"])


def test_fsdp_state_from_2_ranks_onto_4_and_a_2d_mesh(tmp_path):
    # Over 4 ranks the 5-row tensors shard as 2, 2, 1, 0 rows: empty local shards.
    saved = _run("save", 2, tmp_path)[0].result()
    loaded = _run("load", 4, tmp_path)
    _check(saved, loaded, ["1d", "1d-async"], ["1d", "2d"])


def test_a_rank_that_never_reports_is_named(tmp_path):
    done = multiproc.run("torch_job.py", 2, 1, "dies", str(tmp_path), timeout=60, env=ENV)
    res = done[0].result()
    assert res["error"] is not None and "process(es) [1] did not report" in res["error"]
    assert not res["exists"]  # nothing became visible


def test_manager_saves_fsdp_state_async_keeps_two_and_restores_the_newest(tmp_path):
    ranks = multiproc.run("torch_job.py", 2, 1, "managed", str(tmp_path), timeout=150, env=ENV)
    res = [p.result() for p in ranks]
    # torch.distributed's store coordinates (not a single-process coordinator per rank).
    assert {r["coordinator"] for r in res} == {"TorchStoreCoordinator"}
    assert all(r["steps"] == [4, 6] for r in res)  # every 2 steps, the newest 2 kept
    assert all(r["timings"] == [2, 4, 6] for r in res)
    # on disk: only the kept steps (plus the writer lease), nothing half-written
    steps = sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit())
    assert steps == ["4", "6"]
    saved = res[0]["saved"]
    assert sorted(saved) == ["2", "4", "6"]
    assert saved["4"] != saved["6"]
    # A fresh job: both ranks restore step 6 into a new model and optimizer, bit-exact.
    restored = multiproc.run(
        "torch_job.py", 2, 1, "managed-restore", str(tmp_path), timeout=150, env=ENV
    )
    for p in restored:
        r = p.result()
        assert r["steps"] == [4, 6] and r["latest"] == 6 and r["tier"] == "persistent"
        assert r["restored"] == saved["6"], p.process_id


def test_ranks_signalled_at_different_steps_save_at_one_agreed_step(tmp_path):
    from workers.torch_job import SIGNALLED_AT

    ranks = multiproc.run("torch_job.py", 2, 1, "preempt", str(tmp_path), timeout=120, env=ENV)
    res = sorted((p.result() for p in ranks), key=lambda r: r["rank"])
    # Only rank 1 got SIGTERM, at step 3, and it publishes late (rank 0 has checked step 3
    # by then): both ranks save at the step after it.
    assert [r["agreed"] for r in res] == [SIGNALLED_AT + 1] * 2
    assert all(r["steps"] == [SIGNALLED_AT + 1] for r in res)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == [str(SIGNALLED_AT + 1)]
    assert res[0]["saved"] == res[1]["saved"]
    for r in res:  # restored bit-exact into a fresh model and optimizer
        assert r["restored"] == r["saved"], r["rank"]


def test_convert_a_dcp_checkpoint_of_fsdp_state_bit_exact(tmp_path, capsys):
    import torch

    import snapshard.torch as st
    from snapshard.cli import main
    from workers.torch_job import digests

    saved = multiproc.run("torch_job.py", 2, 1, "dcp-save", str(tmp_path), timeout=150, env=ENV)
    want = saved[0].result()["saved"]
    src, dst = tmp_path / "dcp", tmp_path / "converted"
    # Without --trust-pickle: refused, saying why, and nothing written.
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err
    assert "--trust-pickle" in err and "pickle" in err and "runs any code" in err
    assert not dst.exists()
    assert main(["convert", str(src), str(dst), "--trust-pickle", "--json", "--chunk-mb", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["source_format"] == "dcp" and doc["format"] == "snapshard"
    # The same names (the state dict's paths), dtypes, shapes and bytes.
    got = digests(st.load(dst))
    assert got == want
    assert {"model/up.weight", "optim/state/up.weight/exp_avg", "half"} <= set(got)
    assert got["half"].startswith("torch.bfloat16:(7,)")
    # ...from a checkpoint both ranks wrote shards of
    assert sorted(p.name for p in src.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # and loadable in place into a torch target
    target = {"half": torch.zeros(7, dtype=torch.bfloat16), "step": 0}
    st.load(dst, target)
    assert target["step"] == 2 and torch.equal(
        target["half"], torch.linspace(-3, 3, 7, dtype=torch.bfloat16)
    )


def test_a_jax_checkpoint_into_sharded_dtensors_through_renames_and_transposes(tmp_path):
    import numpy as np

    import snapshard

    kernel = np.arange(35, dtype=np.float32).reshape(5, 7)  # JAX's (in, out)
    bias = np.linspace(-1, 1, 7, dtype=np.float32)
    tree = {"params": {"rows": {"kernel": kernel, "bias": bias}, "cols": {"kernel": kernel + 100}}}
    snapshard.save(tmp_path / "jax", tree)
    ranks = multiproc.run("torch_job.py", 2, 1, "transposed", str(tmp_path), timeout=120, env=ENV)
    got = sorted((p.result() for p in ranks), key=lambda r: r["rank"])
    want_rows, want_cols = kernel.T, (kernel + 100).T
    for r in got:
        k = r["rank"]
        rows = np.array_split(np.arange(7), 2)[k]
        cols = np.array_split(np.arange(5), 2)[k]
        np.testing.assert_array_equal(np.array(r["rows.weight"]), want_rows[rows])
        np.testing.assert_array_equal(np.array(r["cols.weight"]), want_cols[:, cols])
        np.testing.assert_array_equal(np.array(r["rows.bias"]), bias)
        # it asked for its own boxes only: its shard of each kernel (transposed), the bias
        assert r["bytes_needed"] == 4 * (5 * len(rows) + 7 * len(cols) + 7)
