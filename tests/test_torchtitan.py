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
