"""snapshard.accelerate: Accelerator.save_state / load_state with the models' weights in a
snapshard checkpoint, through Accelerate's state hooks, with a real Accelerator on CPU."""

from __future__ import annotations

import pytest

import multiproc

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

import snapshard.accelerate as sa  # noqa: E402
import snapshard.torch as sst  # noqa: E402


def setup(seed: int):
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def step(accelerator, model, opt, i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 4, generator=g)
    loss = (model(x) - x.sum(1, keepdim=True).sin()).pow(2).mean()
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()


def test_save_state_and_load_state_go_through_snapshard(tmp_path):
    accelerator, model, opt = setup(0)
    sa.use_snapshard(accelerator)
    for i in range(3):
        step(accelerator, model, opt, i)
    accelerator.save_state(str(tmp_path / "ckpt"))
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert sa.NAME in files and "model.safetensors" not in files, files
    assert "optimizer.bin" in files  # Accelerate's hooks see the models only
    target = {"model_0": {k: torch.empty_like(v) for k, v in model.state_dict().items()}}
    saved = sst.load(tmp_path / "ckpt" / sa.NAME, target)
    for k, v in model.state_dict().items():
        assert torch.equal(saved["model_0"][k], v), k
    for i in range(3, 5):
        step(accelerator, model, opt, i)
    want = {k: v.clone() for k, v in model.state_dict().items()}

    accelerator2, model2, opt2 = setup(1)  # other initial weights
    sa.use_snapshard(accelerator2)
    assert not torch.equal(model2[0].weight, model[0].weight)
    accelerator2.load_state(str(tmp_path / "ckpt"))
    for k, v in saved["model_0"].items():
        assert torch.equal(model2.state_dict()[k], v), k
    for i in range(3, 5):
        step(accelerator2, model2, opt2, i)
    for k, v in want.items():
        assert torch.equal(model2.state_dict()[k], v), k


def test_removing_the_hooks_gives_accelerate_its_own_files_back(tmp_path):
    accelerator, model, _ = setup(0)
    for handle in sa.use_snapshard(accelerator):
        handle.remove()
    accelerator.save_state(str(tmp_path / "plain"))
    files = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert "model.safetensors" in files and sa.NAME not in files
    # a directory saved without snapshard still loads with the hooks on
    accelerator2, model2, _ = setup(1)
    sa.use_snapshard(accelerator2)
    accelerator2.load_state(str(tmp_path / "plain"))
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v), k


def test_a_damaged_snapshard_checkpoint_fails_the_load_naming_it(tmp_path):
    accelerator, _, _ = setup(0)
    sa.use_snapshard(accelerator)
    accelerator.save_state(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / sa.NAME / "manifest.json").write_text("{")
    accelerator2, _, _ = setup(1)
    sa.use_snapshard(accelerator2)
    with pytest.raises(Exception, match=sa.NAME):
        accelerator2.load_state(str(tmp_path / "ckpt"))


@pytest.mark.multiprocess
def test_two_gloo_ranks_save_and_load_through_the_hooks(tmp_path):
    done = multiproc.run(
        "accelerate_ranks.py", 2, 1, tmp_path, timeout=120, env={"OMP_NUM_THREADS": "1"}
    )
    results = [p.result() for p in done]
    assert [r["type"] for r in results] == ["DistributedType.MULTI_CPU"] * 2
    assert [r["procs"] for r in results] == [2, 2]
    assert [r["same"] for r in results] == [True, True]  # reloaded over zeroed weights
    assert sa.NAME in results[0]["files"] and "model.safetensors" not in results[0]["files"]
    assert results[0]["weights"] == results[1]["weights"]  # DDP kept the ranks in step
    weights = results[0]["weights"]
    target = {"model_0": {k: torch.empty(torch.tensor(v).shape) for k, v in weights.items()}}
    saved = sst.load(tmp_path / "ckpt" / sa.NAME, target)
    for k, v in weights.items():
        assert saved["model_0"][k].tolist() == v, k


def test_fsdp_sharded_state_through_snapshards_fsdp_functions(tmp_path):
    done = multiproc.run(
        "accelerate_fsdp.py", 2, 1, tmp_path, timeout=120, env={"OMP_NUM_THREADS": "1"}
    )
    results = [p.result() for p in done]
    assert all(r["weights"] and r["optimizer"] for r in results)
    assert results[0]["files"] == ["optimizer_0", "pytorch_model_fsdp_0"]
    assert ".metadata" in results[0]["own"]  # an accelerator without the switch: DCP's files
    for name in ("optimizer_0", "pytorch_model_fsdp_0"):
        assert (tmp_path / "ckpt" / name / "manifest.json").is_file()
    # a snapshard checkpoint: readable without DCP, with the 2 ranks' shards put together
    whole = sst.load(tmp_path / "ckpt" / "pytorch_model_fsdp_0")
    assert whole["model"]["0.weight"].shape == (8, 4)


def test_the_fsdp_switch_is_installed_once_and_leaves_other_accelerators_alone(monkeypatch):
    import accelerate.accelerator as module

    from snapshard.accelerate import fsdp

    first = sa.fsdp_functions()
    assert first == sa.fsdp_functions() and module.save_fsdp_model is sa.save_fsdp_model
    calls = []
    monkeypatch.setitem(fsdp._ORIGINALS, "save_fsdp_model", lambda *a: calls.append(a))
    plugin, other = object(), Accelerator(cpu=True)  # never given to use_snapshard
    module.save_fsdp_model(plugin, other, None, "dir", 0)
    assert calls == [(plugin, other, None, "dir", 0, False, True)]
