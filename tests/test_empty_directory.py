"""What is at a checkpoint's path already: an existing empty directory is written into by
every entry point (it holds nothing to lose), atomically and without `overwrite`; anything
else keeps its rules. snapshard.torch.StorageWriter overwrites by default, as DCP's
FileSystemWriter, and the old checkpoint stays whole until the new one commits. A PyTorch
DCP checkpoint given to snapshard's loaders says what it is and what reads it."""

from __future__ import annotations

import os
import tempfile
import warnings

import numpy as np
import pytest

import snapshard
from snapshard.errors import CheckpointExistsError, CheckpointNotFoundError
from snapshard.storage import atomic_rename, local

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import snapshard.torch as sst  # noqa: E402
from dcp_errors import dcp_failure  # noqa: E402


@pytest.fixture(autouse=True)
def _single_process_dcp():
    # DCP warns that it saves in one process when no process group exists: it is meant here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


@pytest.fixture
def empty(tmp_path):
    """An existing empty directory, made as DCP's tests and tutorials make one."""
    return tempfile.mkdtemp(dir=tmp_path)


def _numpy_manager(path: str) -> None:
    with snapshard.CheckpointManager(path) as mgr:
        mgr.save(1, {"w": np.arange(6.0)}, force=True)
        mgr.wait_until_finished()


def _torch_manager(path: str) -> None:
    with sst.CheckpointManager(path) as mgr:
        mgr.save(1, {"w": torch.arange(6.0)}, force=True)
        mgr.wait_until_finished()


ENTRY_POINTS = {
    "snapshard.save": lambda p: snapshard.save(p, {"w": np.arange(6.0)}),
    "snapshard.save_async": lambda p: snapshard.save_async(p, {"w": np.arange(6.0)}).wait(),
    "snapshard.torch.save": lambda p: sst.save(p, {"w": torch.arange(6.0)}),
    "snapshard.torch.save_async": lambda p: sst.save_async(p, {"w": torch.arange(6.0)}).wait(),
    "dcp.save(storage_writer=StorageWriter(p))": lambda p: dcp.save(
        {"w": torch.arange(6.0)}, storage_writer=sst.StorageWriter(p, overwrite=False)
    ),
    "dcp.save(checkpoint_id=p)": lambda p: dcp.save(
        {"w": torch.arange(6.0)},
        checkpoint_id=p,
        storage_writer=sst.StorageWriter(p, overwrite=False),
    ),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_save_writes_into_an_existing_empty_directory(empty, entry):
    ENTRY_POINTS[entry](empty)  # overwrite=False throughout: nothing is there to lose
    assert np.array_equal(snapshard.load(empty)["w"], np.arange(6.0))
    parent = os.path.dirname(empty)
    assert os.listdir(parent) == [os.path.basename(empty)]  # the staging area was renamed


@pytest.mark.parametrize("manager", [_numpy_manager, _torch_manager])
def test_both_managers_take_an_existing_empty_root_and_step_directory(tmp_path, manager):
    root = tempfile.mkdtemp(dir=tmp_path)
    os.mkdir(os.path.join(root, "1"))  # made ahead of the save, as a user's script might
    manager(root)
    assert np.array_equal(snapshard.load(os.path.join(root, "1"))["w"], np.arange(6.0))


def test_a_directory_of_other_files_stays_refused(empty):
    keep = os.path.join(empty, "notes.txt")
    with open(keep, "w") as f:
        f.write("keep me")
    for overwrite in (False, True):
        with pytest.raises(CheckpointExistsError, match="not a snapshard checkpoint"):
            snapshard.save(empty, {"w": np.ones(3)}, overwrite=overwrite)
    save = lambda: dcp.save({"w": torch.ones(3)}, storage_writer=sst.StorageWriter(empty))  # noqa: E731
    dcp_failure(save, CheckpointExistsError, "not a snapshard checkpoint; refusing to replace it")
    assert os.listdir(empty) == ["notes.txt"]
    with open(keep) as f:
        assert f.read() == "keep me"
    assert os.listdir(os.path.dirname(empty)) == [os.path.basename(empty)]


@pytest.mark.parametrize("window", [1, 2], ids=["after-the-check", "before-the-rename"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_filled_during_the_commit_is_never_replaced(
    empty, monkeypatch, window, overwrite
):
    # Another program writes into the directory right after the commit's n-th look found it
    # empty: the commit's check (1), or move_into_place's just before the rename (2). The
    # commit then only takes an empty directory, and the kernel's rename(2) refuses a
    # non-empty one, so nothing of theirs is lost, with or without overwrite.
    looked = atomic_rename.is_empty_dir
    looks = []

    def then_filled(path):
        empty_now = looked(path)
        looks.append(empty_now)
        if empty_now and len(looks) == window:
            with open(os.path.join(empty, "late.txt"), "w") as f:
                f.write("late")
        return empty_now  # stale from now on: the race

    for module in (local, atomic_rename):  # the commit's look, and move_into_place's
        monkeypatch.setattr(module, "is_empty_dir", then_filled)
    with pytest.raises(CheckpointExistsError, match="appeared, or was filled, while it was"):
        snapshard.save(empty, {"w": np.ones(3)}, overwrite=overwrite)
    assert os.listdir(empty) == ["late.txt"]
    assert os.listdir(os.path.dirname(empty)) == [os.path.basename(empty)]  # staging removed


def test_an_empty_working_directory_and_a_link_to_an_empty_directory_are_refused(
    tmp_path, monkeypatch
):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(CheckpointExistsError, match="working directory"):
        snapshard.save(str(work), {"w": np.ones(3)})
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(CheckpointExistsError, match="is a symbolic link; save to the path it"):
        snapshard.save(str(tmp_path / "link"), {"w": np.ones(3)})
    assert (tmp_path / "link").is_symlink() and os.listdir(target) == []


def _dcp_state(step: int) -> dict:
    return {"w": torch.full((4, 3), float(step)), "step": step}


def _dcp_target() -> dict:
    return {"w": torch.zeros(4, 3), "step": 0}


def test_storage_writer_overwrites_by_default_as_filesystem_writer(tmp_path):
    path = str(tmp_path / "ck")
    dcp.save(_dcp_state(1), storage_writer=sst.StorageWriter(path))
    dcp.save(_dcp_state(2), storage_writer=sst.StorageWriter(path))  # no overwrite=True
    target = _dcp_target()
    dcp.load(target, storage_reader=sst.StorageReader(path))
    assert target["step"] == 2 and torch.equal(target["w"], torch.full((4, 3), 2.0))
    again = lambda: dcp.save(  # noqa: E731
        _dcp_state(3), storage_writer=sst.StorageWriter(path, overwrite=False)
    )
    dcp_failure(again, CheckpointExistsError, r"already exists .*overwrite=True")
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def _old_is_whole(path: str, step: int) -> None:
    target = _dcp_target()
    dcp.load(target, storage_reader=sst.StorageReader(path))
    assert target["step"] == step and torch.equal(target["w"], torch.full((4, 3), float(step)))


def test_the_overwritten_checkpoint_is_whole_until_the_new_one_commits(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    dcp.save(_dcp_state(1), storage_writer=sst.StorageWriter(path))
    seen = []
    checked = local.LocalStorage._check_replaceable

    def read_old_first(self, overwrite):  # the last step before the swap
        _old_is_whole(path, 1)
        seen.append(overwrite)
        checked(self, overwrite)

    monkeypatch.setattr(local.LocalStorage, "_check_replaceable", read_old_first)
    dcp.save(_dcp_state(2), storage_writer=sst.StorageWriter(path))
    assert seen == [True]
    monkeypatch.undo()
    _old_is_whole(path, 2)

    def refused(self, manifest, *, overwrite):
        raise OSError(5, "injected: commit refused")

    monkeypatch.setattr(local.LocalStorage, "commit", refused)
    failing = lambda: dcp.save(_dcp_state(3), storage_writer=sst.StorageWriter(path))  # noqa: E731
    dcp_failure(failing, OSError, "commit refused")
    monkeypatch.undo()
    _old_is_whole(path, 2)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_overwrite_on_an_object_store_keeps_the_old_checkpoint_until_the_manifest_put():
    pytest.importorskip("obstore")
    from snapshard.storage import objstore

    url = "memory://bucket/empty-dir-overwrite/ck"
    dcp.save(_dcp_state(1), storage_writer=sst.StorageWriter(url))
    put = objstore.ObjectStorage.commit
    calls = []

    def read_old_first(self, manifest, *, overwrite):
        _old_is_whole(url, 1)  # the new save's files are all there, beside the old ones
        calls.append(overwrite)
        put(self, manifest, overwrite=overwrite)

    objstore.ObjectStorage.commit = read_old_first  # type: ignore[method-assign]
    try:
        dcp.save(_dcp_state(2), storage_writer=sst.StorageWriter(url))
    finally:
        objstore.ObjectStorage.commit = put  # type: ignore[method-assign]
    assert calls == [True]
    _old_is_whole(url, 2)
    assert snapshard.storage.storage_for(url).list_staging() == {}  # the old files deleted


def _dcp_native(tmp_path) -> str:
    path = str(tmp_path / "native")
    dcp.save({"w": torch.ones(3)}, checkpoint_id=path)  # DCP's own FileSystemWriter
    assert os.path.isfile(os.path.join(path, ".metadata"))
    return path


ADVICE = (
    r"is a PyTorch DCP checkpoint .*load it with DCP's own reader \(dcp\.load\(state, "
    r"checkpoint_id=path\), or storage_reader=FileSystemReader\(path\)\), or convert it once: "
    r"snapshard convert --trust-pickle .* NEW_PATH"
)


def test_a_dcp_native_checkpoint_says_what_it_is_and_what_reads_it(tmp_path):
    path = _dcp_native(tmp_path)
    for load in (
        lambda: snapshard.load(path),
        lambda: sst.load(path, {"w": torch.zeros(3)}),
        lambda: snapshard.metadata(path),
    ):
        with pytest.raises(CheckpointNotFoundError, match=ADVICE) as info:
            load()
        assert "no manifest.json" in str(info.value) and path in str(info.value)
    through_dcp = lambda: dcp.load(  # noqa: E731
        {"w": torch.zeros(3)}, storage_reader=sst.StorageReader(path)
    )
    with pytest.raises(BaseException, match=ADVICE):  # inside DCP's CheckpointException
        through_dcp()
    target = {"w": torch.zeros(3)}
    dcp.load(target, checkpoint_id=path)  # what the message advises does read it
    assert torch.equal(target["w"], torch.ones(3))


def test_a_dcp_native_checkpoint_is_never_replaced(tmp_path):
    path = _dcp_native(tmp_path)
    before = sorted(os.listdir(path))
    save = lambda: dcp.save({"w": torch.zeros(3)}, storage_writer=sst.StorageWriter(path))  # noqa: E731
    dcp_failure(
        save, CheckpointExistsError, "holds a PyTorch DCP checkpoint .*refusing to replace it"
    )
    with pytest.raises(CheckpointExistsError, match="holds a PyTorch DCP checkpoint; save to"):
        snapshard.save(path, {"w": np.ones(3)})
    assert sorted(os.listdir(path)) == before


def test_plan_caching_is_refused_at_the_first_save(tmp_path):
    from torch.distributed.checkpoint import DefaultSavePlanner

    path = str(tmp_path / "ck")
    save = lambda: dcp.save(  # noqa: E731
        {"w": torch.ones(3)}, storage_writer=sst.StorageWriter(path),
        planner=DefaultSavePlanner(enable_plan_caching=True),
    )  # fmt: skip
    dcp_failure(save, sst.DcpStorageError, r"plan caching .*pass a planner without it")
    assert os.listdir(tmp_path) == []  # refused before anything was staged
