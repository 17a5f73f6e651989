"""State that differs by rank (SaveOptions(trees_differ=True)): pipeline stages saved by
snapshard.torch.save, save_async and the torch CheckpointManager on 2 and 4 gloo ranks,
loaded bit-exact onto 1, 2 and 4 ranks with other stage splits, into NumPy-free CPU
tensors with no target, and through dcp.load; experts of a mixture-of-experts block with
AdamW, SGD momentum and a Muon-style optimizer resharded over expert-parallel degrees;
torchtitan's manager with two stages per rank. Every tensor of model and optimizer state
is compared (sha256 of its full value), not the loss."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import multiproc

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}


def _run(n: int, *args: object, timeout: float = 150) -> list[dict]:
    return [
        p.result() for p in multiproc.run("trees_differ.py", n, 1, *args, timeout=timeout, env=ENV)
    ]


def _union(results: list[dict], key: str | None = None) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in results:
        got = r["hashes"] if key is None else r["hashes"][key]
        for name, h in got.items():
            assert out.setdefault(name, h) == h, name  # ranks agree on what they share
    return out


def _same(saved: dict[str, str], loaded: dict[str, str]) -> None:
    assert set(loaded) == set(saved)
    differ = [k for k in saved if saved[k] != loaded[k]]
    assert not differ, differ


def test_pipeline_stages_of_plain_tensors_load_onto_other_splits(tmp_path):
    """2 ranks, 2 stages (plain tensors, keys differ by rank), saved synchronously; loaded
    by 1 rank holding every layer (and whole, with no target), and by 4 ranks of one layer
    each (read-once asked for too, and through dcp.load)."""
    ck = tmp_path / "ck"
    saved = _union(_run(2, "save", ck, 2, "sync"))
    assert any(k.startswith("optim/state.layers.3.") for k in saved)  # AdamW state, per layer
    manifest = json.loads((ck / "manifest.json").read_text())
    assert manifest["version"] == "2.2"
    assert not list(ck.glob("index/*.tree.json"))  # the committer's inputs are gone
    one = _run(1, "load", ck, 1, "torch,whole")
    _same(saved, _union(one, "torch"))
    whole = one[0]["hashes"]["whole"]
    assert whole == {k: saved[k] for k in whole}
    assert {k for k in saved if k.startswith("model/")} <= set(whole)
    four = _run(4, "load", ck, 4, "torch,torch-once,dcp")
    for how in ("torch", "torch-once", "dcp"):
        _same(saved, _union(four, how))
    # every byte and record file checked against the manifest by the CLI
    env = {**os.environ, "PYTHONPATH": str(multiproc.SRC)}
    verify = subprocess.run(
        [sys.executable, "-m", "snapshard", "verify", str(ck)], capture_output=True, text=True,
        env=env, timeout=120,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_pipeline_stages_times_fsdp_async_onto_one_rank_and_four_stages(tmp_path):
    """4 ranks, 2 stages of 2 ranks each: each stage's DTensors on its own sub-mesh, saved
    with save_async; loaded by 1 rank, and by 4 stages of 1 rank (also through dcp)."""
    ck = tmp_path / "ck"
    saved = _union(_run(4, "save", ck, 2, "async"))
    _same(saved, _union(_run(1, "load", ck, 1, "torch"), "torch"))
    four = _run(4, "load", ck, 4, "torch,dcp")
    _same(saved, _union(four, "torch"))
    _same(saved, _union(four, "dcp"))


def test_the_torch_manager_saves_stages_and_restores_them_onto_two(tmp_path):
    """4 ranks, 4 stages, through snapshard.torch.CheckpointManager; 2 ranks of 2 stages
    restore through the manager and through snapshard.torch.load."""
    saved = _union(_run(4, "save", tmp_path, 4, "manager"))
    two = _run(2, "load", tmp_path / "1", 2, "manager,torch")
    _same(saved, _union(two, "manager"))
    _same(saved, _union(two, "torch"))


def test_a_key_given_with_two_shapes_fails_every_rank_naming_it(tmp_path):
    for r in _run(2, "clash", tmp_path, timeout=90):
        trees_differ, whole = r["True"], r["False"]
        assert not trees_differ["exists"] and not whole["exists"]
        assert (
            "leaf 'shared' is float32[2] on process 0 and float32[3] on process 1"
            in (trees_differ["error"])
        )
        # without trees_differ the trees differ, and the message says what trees_differ is for
        assert "the trees differ" in whole["error"]
        assert "SaveOptions(trees_differ=True)" in whole["error"]
        # A DTensor copy on each stage's own mesh (and a plain tensor beside a DTensor): no
        # process holds both values, so keeping one would silently drop the other's.
        for name in ("dtensors", "plain-dtensor"):
            assert not r[name]["exists"], name
            assert "leaf 'x' is saved as two copies, on process 0" in r[name]["error"], name
            assert "whose values cannot be compared" in r[name]["error"], name
        # Without trees_differ a DTensor on a stage's sub-mesh is taken to be copied along
        # the other stage: stages whose tensors share names are refused, not saved mixed,
        # in threads and in a writer process; copies that are equal are saved.
        for name in ("stages", "stages-writer"):
            assert not r[name]["exists"], name
            assert "processes 0 and 1 hold copies of the same part" in r[name]["error"], name
            assert "(leaf '0.weight':" in r[name]["error"], name  # (the bias: 4 signs only)
            assert "SaveOptions(trees_differ=True)" in r[name]["error"], name
        assert r["copies"] == {"error": None, "exists": True}


def test_stages_under_one_name_on_sub_meshes_are_refused_and_copies_saved(tmp_path):
    """4 ranks, (pp 2, dp 2), without trees_differ: a tensor sharded over each stage's dp
    mesh is taken to be copied along pp. Where it is (each dp position holds its own shard,
    alike on both stages, or apart in the last bits only), it is saved and loads back
    whole; where the stages hold their own values under that name, every rank is refused,
    naming it, and nothing is left."""
    full = [[float(3 * r + c) for c in range(3)] for r in range(8)]
    for r in _run(4, "submesh", tmp_path, timeout=120):
        assert r["copies"] == r["drift"] == {"error": None, "exists": True}
        assert r["loaded"] == full
        assert not r["mixed"]["exists"]
        assert "hold copies of the same part of an array" in r["mixed"]["error"]
        assert "that are different tensors" in r["mixed"]["error"]
        assert "(leaf 'w':" in r["mixed"]["error"]


def test_a_rank_without_state_or_per_process_values_takes_part(tmp_path):
    """Rank 0 alone holds a tensor and a PerProcess value, rank 1 nothing: the save commits
    (rank 1 has no values file), and both ranks load what they saved, with read-once asked
    for (rank 1's empty plan must not leave rank 0 waiting) and by default; with no target,
    rank 1 gets the tensor and no value of rank 0's."""
    first, second = _run(2, "uneven", tmp_path / "ck", timeout=120)
    for once in ("True", "None"):
        assert first["loaded"][once] == {"w": [0.0, 1.0, 2.0, 3.0], "loader": {"seen": 17}}
        assert second["loaded"][once] == {}
    # With no target each rank gets what the job saved, its own per-process values among it
    assert first["loaded"]["all"] == {"w": [0.0, 1.0, 2.0, 3.0], "loader": {"seen": 17}}
    assert second["loaded"]["all"] == {"w": [0.0, 1.0, 2.0, 3.0]}
    jax_first, jax_second = (  # and so with JAX's load, 2 processes
        p.result()["loaded"]
        for p in multiproc.run("per_process.py", 2, 2, "uneven", tmp_path / "ck", timeout=120)
    )
    assert jax_first == first["loaded"]["all"] and jax_second == second["loaded"]["all"]
    index = tmp_path / "ck" / "index"
    assert [p.name[:7] for p in index.glob("*.values*")] == ["p00000-"]


def test_experts_and_their_optimizer_state_reshard_over_expert_degrees(tmp_path):
    """Experts Shard(0) over `ep` (x FSDP over `dp` where the world is larger), with AdamW,
    SGD momentum and a Muon-style momentum_buffer: saved at degree 2, loaded at 1, 2 (x2
    FSDP) and 4, every tensor of the optimizer state compared."""
    saved = _run(2, "moe-save", tmp_path, 2)[0]["hashes"]
    for opt in ("adamw", "sgd", "muon"):
        kinds = {k.rsplit(".", 1)[-1] for k in saved[opt] if k.startswith("optim/state.")}
        assert kinds >= {"adamw": {"exp_avg", "exp_avg_sq", "step"},
                         "sgd": {"momentum_buffer"}, "muon": {"momentum_buffer"}}[opt]  # fmt: skip
    for n, ep in ((1, 1), (4, 2), (4, 4)):
        loaded = _run(n, "moe-load", tmp_path, ep)
        for opt in ("adamw", "sgd", "muon"):
            _same(saved[opt], _union(loaded, opt))


def test_torchtitan_manager_with_two_stages_trees_differ_loads_onto_one_rank(tmp_path):
    pytest.importorskip("torchtitan")
    saved = _union(_run(2, "titan-save", tmp_path))
    assert sum(k.startswith("model/layers.") for k in saved) == 8  # 4 layers, weight + bias
    loaded = _run(1, "titan-load", tmp_path)[0]
    assert loaded["loaded"] is True
    _same(saved, loaded["hashes"])


def test_the_torchtitan_pipeline_example_of_the_docs_runs_on_2_ranks(tmp_path):
    pytest.importorskip("torchtitan")
    text = (multiproc.SRC.parent / "docs" / "integrations.md").read_text()
    block = re.findall(
        r"^<!-- tested: torchtitan-pipeline -->\n```python\n(.*?)^```", text, flags=re.S | re.M
    )
    assert len(block) == 1
    script = tmp_path / "example.py"
    script.write_text(block[0])
    work = tmp_path / "job"
    work.mkdir()
    done = multiproc.run("torch_docs.py", 2, 1, script, work, timeout=150, env=ENV)
    assert [p.result()["done"] for p in done] == [True, True]
    assert (work / "run" / "ckpt" / "1" / "manifest.json").exists()
