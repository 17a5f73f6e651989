"""snapshard.orbax: Orbax's CheckpointManager (and its v1 API) writing snapshard checkpoints.

In this process (8 CPU devices): steps kept at the save interval, old ones removed,
restores onto another sharding and into NumPy, the items readable by snapshard.load and
`snapshard verify`, the options applied, bad arguments refused. Across real processes: a
2-process run whose process 1 is SIGKILLed while a save is in flight (the last committed
step restores on 1 process with another device count; no partial step is visible), and a
checkpoint saved here restored on 2 processes, and the v1 API saving and loading on 2.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multiproc

ocp = pytest.importorskip("orbax.checkpoint")

import snapshard  # noqa: E402
import snapshard.orbax  # noqa: E402
from snapshard.cli import main as cli  # noqa: E402
from workers.orbax_handler_job import COLS, ROWS, state_at  # noqa: E402

from conftest import mesh  # noqa: E402


def on_devices(step: int) -> dict:
    host = state_at(step)
    m = mesh(2, 4)
    return {
        "w": jax.device_put(host["w"], NamedSharding(m, P("data", "model"))),
        "b": jax.device_put(host["b"], NamedSharding(m, P())),
        "step": step,
    }


def manager(root, handler=None, *, asynchronous=True, interval=2, keep=2):
    opts = ocp.CheckpointManagerOptions(
        save_interval_steps=interval, max_to_keep=keep, enable_async_checkpointing=asynchronous
    )
    return ocp.CheckpointManager(
        root, options=opts, item_names=("state",),
        item_handlers={"state": handler or snapshard.orbax.Handler()},
    )  # fmt: skip


def save_steps(mgr, steps) -> list[int]:
    saved = [
        s
        for s in steps
        if mgr.save(s, args=ocp.args.Composite(state=snapshard.orbax.Save(on_devices(s))))
    ]
    mgr.wait_until_finished()
    return saved


def same(restored: dict, step: int) -> bool:
    want = state_at(step)
    return restored["step"] == step and all(
        np.array_equal(np.asarray(restored[k]), want[k]) for k in ("w", "b")
    )


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_manager_keeps_the_interval_and_the_latest_and_restores_resharded(tmp_path, asynchronous):
    root = tmp_path / "root"
    with manager(root, asynchronous=asynchronous) as mgr:
        assert save_steps(mgr, range(7)) == [0, 2, 4, 6]
        assert mgr.all_steps() == [4, 6]
        assert not (root / "0").exists() and not (root / "2").exists()
        m = mesh(4, 2)
        target = {
            "w": jax.ShapeDtypeStruct(
                (ROWS, COLS), np.float32, sharding=NamedSharding(m, P(None, "data"))
            ),
            "b": jax.ShapeDtypeStruct((COLS,), np.int32, sharding=NamedSharding(m, P("data"))),
            "step": 0,
        }
        out = mgr.restore(6, args=ocp.args.Composite(state=snapshard.orbax.Restore(target)))[
            "state"
        ]
        assert out["w"].sharding == target["w"].sharding and same(out, 6)
        numpy = mgr.restore(4, args=ocp.args.Composite(state=snapshard.orbax.Restore()))["state"]
        assert isinstance(numpy["w"], np.ndarray) and same(numpy, 4)
        meta = mgr.item_metadata(6)["state"]
        assert meta["w"].shape == (ROWS, COLS) and meta["w"].sharding["spec"] == ["data", "model"]
    item = root / "6" / "state"
    assert same(snapshard.load(item), 6)
    assert cli(["verify", str(item)]) == 0
    assert not [p.name for p in root.iterdir() if "tmp" in p.name]


def test_steps_orbax_wrote_restore_through_the_handler(tmp_path):
    """A run that switches handlers resumes from the last step Orbax's own handler wrote
    (snapshard reads Orbax checkpoints), then saves snapshard steps beside it."""
    root = tmp_path / "root"
    with ocp.CheckpointManager(root, item_names=("state",)) as mgr:
        mgr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(on_devices(2))))
    m = mesh(8)
    target = {
        "w": jax.ShapeDtypeStruct(
            (ROWS, COLS), np.float32, sharding=NamedSharding(m, P(None, "data"))
        ),
        "b": jax.ShapeDtypeStruct((COLS,), np.int32, sharding=NamedSharding(m, P())),
        "step": 0,
    }
    with manager(root) as mgr:
        out = mgr.restore(2, args=ocp.args.Composite(state=snapshard.orbax.Restore(target)))
        assert out["state"]["w"].sharding == target["w"].sharding and same(out["state"], 2)
        assert save_steps(mgr, [4]) == [4] and mgr.all_steps() == [2, 4]
    assert (root / "4" / "state" / "manifest.json").exists()


def test_handler_options_apply_to_every_save_and_restore(tmp_path):
    handler = snapshard.orbax.Handler(
        save_options=snapshard.SaveOptions(compression="zstd"),
        read_options=snapshard.ReadOptions(verify=False),
    )
    with manager(tmp_path / "root", handler, interval=1) as mgr:
        save_steps(mgr, [3])
        item = tmp_path / "root" / "3" / "state"
        assert "zstd" in json.loads((item / "manifest.json").read_text())["codecs"]
        assert same(mgr.restore(3)["state"], 3)
    with pytest.raises(TypeError, match=r"save_options must be a snapshard\.SaveOptions"):
        snapshard.orbax.Handler(save_options={"compression": "zstd"})
    with pytest.raises(TypeError, match=r"read_options must be a snapshard\.ReadOptions"):
        snapshard.orbax.Handler(read_options=snapshard.SaveOptions())


def test_wrong_args_and_uncommitted_items_are_refused(tmp_path):
    handler = snapshard.orbax.Handler()
    with pytest.raises(TypeError, match=r"snapshard.orbax.Save\(tree\), not StandardSave"):
        handler.save(tmp_path / "item", ocp.args.StandardSave({"x": np.ones(2)}))
    with pytest.raises(TypeError, match=r"snapshard.orbax.Restore\(target\), not StandardRestore"):
        handler.restore(tmp_path / "item", ocp.args.StandardRestore())
    (tmp_path / "empty").mkdir()
    with pytest.raises(snapshard.SnapshardError, match="no committed snapshard checkpoint"):
        handler.finalize(tmp_path / "empty")


class ZstdHandler(snapshard.orbax.CheckpointableHandler):
    save_options = snapshard.SaveOptions(compression="zstd")


def test_v1_checkpointables_save_and_load_with_the_class_options(tmp_path):
    v1 = pytest.importorskip("orbax.checkpoint.experimental.v1")
    registry = v1.handlers.local_registry()
    registry.add(ZstdHandler, checkpointable_name="train_state")
    ctx = v1.Context()
    ctx.checkpointables.registry = registry
    path, m = tmp_path / "ckpt", mesh(8)
    target = {
        "w": jax.ShapeDtypeStruct(
            (ROWS, COLS), np.float32, sharding=NamedSharding(m, P(None, "data"))
        ),
        "b": np.zeros(COLS, np.int32),
        "step": 0,
    }
    with ctx:
        v1.save_checkpointables(path, {"train_state": on_devices(5)})
        out = v1.load_checkpointables(path, {"train_state": target})["train_state"]
        assert same(v1.load_checkpointables(path)["train_state"], 5)  # by the saved handler
    assert out["w"].sharding == target["w"].sharding and same(out, 5)
    item = path / "train_state"
    assert "zstd" in json.loads((item / "manifest.json").read_text())["codecs"]
    assert same(snapshard.load(item), 5)
    assert cli(["verify", str(item)]) == 0


def _wait_for_exit(proc, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll()


@pytest.mark.multiprocess
def test_process_killed_mid_save_leaves_the_last_committed_step(tmp_path):
    root = tmp_path / "root"
    procs = multiproc.start("orbax_handler_job.py", 2, 2, ["train", str(root), 8, 6])
    try:
        code = _wait_for_exit(procs[1], 120)
        assert code == -9, f"process 1 exited {code}:\n{procs[1].communicate()[1][-3000:]}"
    finally:
        multiproc.kill_all(procs)  # the whole job dies: process 0 too, mid-save of step 6
    assert sorted(p.name for p in root.iterdir() if "tmp" not in p.name) == ["2", "4"]
    (p,) = multiproc.run("orbax_handler_job.py", 1, 3, "restore", root, timeout=120)
    r = p.result()
    assert r["ok"] and r["step"] == 4 and r["steps"] == [2, 4] and r["shards"] == 3, r
    assert sorted(p.name for p in root.iterdir()) == ["2", "4"]  # step 6's tmp removed
    assert same(snapshard.load(root / "4" / "state"), 4)
    assert cli(["verify", str(root / "4" / "state")]) == 0


@pytest.mark.multiprocess
def test_saved_on_one_process_restores_on_two(tmp_path):
    root = tmp_path / "root"
    with manager(root) as mgr:
        save_steps(mgr, range(4))
    done = multiproc.run("orbax_handler_job.py", 2, 2, "restore", root, timeout=120)
    for p in done:
        r = p.result()
        assert r["ok"] and r["processes"] == 2 and r["step"] == 2 and r["shards"] == 2, r


@pytest.mark.multiprocess
def test_v1_on_two_processes(tmp_path):
    path = tmp_path / "ckpt"
    for p in multiproc.run("orbax_handler_job.py", 2, 2, "v1", path, timeout=120):
        assert p.result()["ok"], p.result()
    assert same(snapshard.load(path / "train_state"), 3)
