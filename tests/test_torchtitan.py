"""snapshard.torchtitan.CheckpointManager with torchtitan's own classes, on 2 gloo ranks."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.components.checkpointer")

import multiproc


def test_two_ranks_save_async_keep_latest_and_resume(tmp_path):
    procs = multiproc.run("torchtitan_ckpt.py", 2, 1, tmp_path, timeout=120)
    for p in procs:
        r = p.result()
        assert r["saved"] == [False, True, False, True]  # interval 2
        assert r["steps"] == [2, 4]
        assert r["loaded"] is True and r["step"] == 4
        assert r["same"] is True  # the FSDP shards as step 4 left them
        assert r["exp_avg"] > 0  # AdamW's state came back
        assert r["batch"] == r["want_batch"]  # the data loader resumes where it was


def test_bad_config_is_refused(tmp_path):
    import torch

    from snapshard.torchtitan import CheckpointManager

    config = CheckpointManager.Config(enable=True, exclude_from_loading=["nope"])
    with pytest.raises(ValueError, match="exclude_from_loading names"):
        config.build(
            dataloader=None,
            model_parts=[torch.nn.Linear(2, 2)],
            optimizers=None,
            lr_schedulers=None,
            states={},
            sd_adapter=None,
            base_folder=str(tmp_path),
        )
    config = CheckpointManager.Config(enable=True, last_save_model_only=True, last_save_in_hf=True)
    with pytest.raises(ValueError, match="sd_adapter"):
        config.build(
            dataloader=None,
            model_parts=[torch.nn.Linear(2, 2)],
            optimizers=None,
            lr_schedulers=None,
            states={},
            sd_adapter=None,
            base_folder=str(tmp_path),
        )


class _Adapter:
    """A state dict adapter as torchtitan's models have: torchtitan names <-> HF names."""

    def to_hf(self, sd):
        return {f"hf.{k}": v for k, v in sd.items()}

    def from_hf(self, sd):
        return {k.removeprefix("hf."): v for k, v in sd.items()}


def _parts(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _build(tmp_path, model, **config):
    from snapshard.torchtitan import CheckpointManager

    return CheckpointManager.Config(enable=True, **config).build(
        dataloader=None,
        model_parts=[model],
        optimizers=None,
        lr_schedulers=None,
        states={},
        sd_adapter=_Adapter(),
        base_folder=str(tmp_path),
    )


def test_initial_load_from_dcp_and_last_step_hf_export_round_trip(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    import snapshard.safetensors as sts

    src = _parts(0)
    dcp.save(dict(src.state_dict()), checkpoint_id=str(tmp_path / "dcp"))  # torchtitan's layout
    model = _parts(1)
    mgr = _build(
        tmp_path, model, folder="a", initial_load_path=str(tmp_path / "dcp"),
        last_save_in_hf=True, export_dtype="bfloat16",
    )  # fmt: skip
    assert mgr.load() is True  # nothing in the folder: the initial checkpoint
    assert all(torch.equal(model.state_dict()[k], v) for k, v in src.state_dict().items())
    assert mgr.save(3, last_step=False) is False  # interval 500
    assert mgr.save(7, last_step=True) is True
    mgr.close()
    hf = sts.load(tmp_path / "a" / "step-7-hf")
    assert sorted(hf) == sorted(f"hf.{k}" for k in src.state_dict())
    assert hf["hf.0.weight"].dtype.name == "bfloat16"

    again = _parts(2)
    mgr = _build(
        tmp_path, again, folder="b", initial_load_path=str(tmp_path / "a" / "step-7-hf"),
        initial_load_in_hf=True,
    )  # fmt: skip
    assert mgr.load() is True
    want = {k: v.to(torch.bfloat16).float() for k, v in src.state_dict().items()}
    assert all(torch.equal(again.state_dict()[k], v) for k, v in want.items())
    mgr.close()


def test_load_only_saves_nothing_and_a_missing_step_is_named(tmp_path):
    mgr = _build(tmp_path, _parts(0), interval=1, load_only=True)
    assert mgr.save(1) is False and mgr.save(2, last_step=True) is False
    with pytest.raises(FileNotFoundError, match="no checkpoint of step 5"):
        mgr.load(step=5)
    mgr.close()
    mgr = _build(tmp_path, _parts(0), initial_load_path=str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mgr.load()
    mgr.close()
