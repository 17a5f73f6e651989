"""The local read side opens only regular files inside the checkpoint, never blocks, and
storage failures are StorageErrors naming the path and the operation."""

from __future__ import annotations

import errno
import os

import jax
import numpy as np
import pytest

import snapshard
from snapshard.coordination import SingleProcessCoordinator
from snapshard.errors import CorruptCheckpointError, DeletedArrayError, StorageError
from snapshard.storage import local
from snapshard.storage.local import LocalStorage

from conftest import run_bounded

pytestmark = pytest.mark.timeout(60)


def bounded(fn, seconds=10.0):
    """fn() in a thread; fails the test (instead of hanging it) if it does not return."""
    value, error = run_bounded(fn, seconds)
    if error is not None:
        raise error
    return value


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    snapshard.save(path, {"a": np.arange(1000, dtype=np.float32), "b": np.ones((4, 4))})
    return path


def _data_file(path):
    return sorted((path / "data").iterdir())[0]


def test_a_symlinked_data_file_is_not_followed(saved, tmp_path):
    f = _data_file(saved)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(f.read_bytes())
    f.unlink()
    f.symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match=f"{f.name}.*symbolic link"):
        snapshard.load(saved)


def test_a_symlinked_data_directory_is_not_followed(saved, tmp_path):
    (saved / "data").rename(tmp_path / "elsewhere")
    (saved / "data").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CorruptCheckpointError, match="data/ is not a directory of the checkpoint"):
        snapshard.load(saved)


def test_a_symlinked_manifest_is_not_followed(saved, tmp_path):
    outside = tmp_path / "manifest.json"
    outside.write_bytes((saved / "manifest.json").read_bytes())
    (saved / "manifest.json").unlink()
    (saved / "manifest.json").symlink_to(outside)
    assert not LocalStorage(saved).is_committed()
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json.*symbolic link"):
        snapshard.load(saved)


def test_a_fifo_instead_of_a_data_file_or_the_manifest_never_blocks(saved):
    f = _data_file(saved)
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(CorruptCheckpointError, match=f"{f.name}.*a FIFO"):
        bounded(lambda: snapshard.load(saved))
    (saved / "manifest.json").unlink()
    os.mkfifo(saved / "manifest.json")
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json.*a FIFO"):
        bounded(lambda: LocalStorage(saved).read_manifest())


def test_file_names_leading_out_of_the_checkpoint_are_refused(saved):
    s = LocalStorage(saved)
    buf = memoryview(bytearray(4))
    for name in ("../x", "data/../../x", "/etc/passwd", "other/x", "data/a/b", ""):
        with pytest.raises(CorruptCheckpointError, match="does not name a file"):
            s.read_into(name, 0, [buf])


def test_disk_full_while_writing_is_a_storage_error_naming_the_file(tmp_path, monkeypatch):
    real = os.write

    def full(fd, data):
        if len(data) > 100:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(local.os, "write", full)
    with pytest.raises(StorageError) as info:
        snapshard.save(tmp_path / "ckpt", {"a": np.zeros(10_000)})
    assert info.value.errno == errno.ENOSPC
    assert (
        "write" in str(info.value)
        and "ckpt.snapshard-tmp" in str(info.value)
        and "/data/" in str(info.value)
    )
    assert "[ENOSPC]" in str(info.value)
    monkeypatch.undo()
    assert not (tmp_path / "ckpt").exists()


def test_a_read_only_location_is_a_storage_error_naming_the_staging_directory(
    tmp_path, monkeypatch
):
    def read_only(path, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(local.os, "makedirs", read_only)
    with pytest.raises(StorageError, match=r"creation of the staging directory .*\[EROFS\]"):
        snapshard.save(tmp_path / "ckpt", {"a": np.zeros(10)})


def test_an_io_error_while_reading_is_a_storage_error(saved, monkeypatch):
    def eio(*a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(local.os, "preadv", eio)
    with pytest.raises(StorageError, match=r"read \(at byte \d+\) of .*(data|index)/.*\[EIO\]"):
        snapshard.load(saved)


def test_an_empty_path_and_the_working_directory_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="empty checkpoint path"):
        snapshard.save("", {"a": 1}, overwrite=True)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(snapshard.errors.CheckpointExistsError, match="working directory"):
        snapshard.save(str(tmp_path), {"a": 1}, overwrite=True)
    assert (tmp_path / "keep.txt").exists()


def test_staging_named_per_attempt_never_shares_with_another_job(tmp_path):
    a, b = LocalStorage(tmp_path / "ckpt"), LocalStorage(tmp_path / "ckpt")
    a.set_attempt("job-a")
    b.set_attempt("job-b")
    snapshard.save(a, {"x": np.arange(3)})
    with pytest.raises(snapshard.errors.CheckpointExistsError):
        snapshard.save(b, {"x": np.arange(4)})
    assert list(snapshard.load(tmp_path / "ckpt")["x"]) == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_deleted_array_is_named(tmp_path):
    x = jax.numpy.arange(8.0)
    x.delete()
    with pytest.raises(DeletedArrayError, match=r"leaf .params/w..*deleted or donated"):
        snapshard.save(tmp_path / "c", {"params": {"w": x}})


def test_a_save_leaves_no_coordination_keys(tmp_path):
    coord = SingleProcessCoordinator()
    for i in range(3):
        snapshard.save(tmp_path / f"c{i}", {"a": np.arange(4)}, coordinator=coord)
    assert coord.keys() == []


def test_single_process_directory_operations():
    c = SingleProcessCoordinator()
    c.set("a/1", "x")
    c.set("a/2", "y")
    c.set("ab/3", "z")
    assert c.get_dir("a") == {"1": "x", "2": "y"}
    assert c.increment("a/n") == 1 and c.increment("a/n", 2) == 3
    assert c.set_if_absent("t", "first") == "first" and c.set_if_absent("t", "2nd") == "first"
    c.delete("a")
    assert c.keys() == ["ab/3", "t"]


def test_the_job_token_is_stable_and_shared():
    c = SingleProcessCoordinator()
    t = c.job_token()
    assert t == c.job_token() and t.isalnum() and len(t) == 12
    assert SingleProcessCoordinator().job_token() != t
