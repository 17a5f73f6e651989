"""The mount table lookup behind read-once's default: network filesystems are told from the
machine's own disks by the mount that holds the checkpoint."""

from __future__ import annotations

import sys

import pytest

from snapshard.coordination import SingleProcessCoordinator
from snapshard.reading.read_once_policy import wanted
from snapshard.storage.mounts import filesystem_type, is_network_filesystem

# Fields: id, parent, dev, root, mount point, options, optional tags, "-", fstype, source, super
MOUNTS = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:40 / {root}/shared rw,relatime shared:7 - nfs4 fs:/export rw,vers=4.2
31 30 0:41 / {root}/shared/scratch rw - xfs /dev/nvme0n1 rw
32 22 0:42 / {root}/lus rw - lustre 10.0.0.1@o2ib:/fs rw
33 22 0:43 / {root}/with\\040space rw - fuse.gcsfuse bucket rw
34 22 0:44 / {root}/sharedx rw - ext4 /dev/sdb rw
35 22 0:45 / {root}/lus rw - tmpfs tmpfs rw
"""


@pytest.fixture
def table(tmp_path):
    root = str(tmp_path)
    for d in ("shared/scratch/run", "lus", "with space/ckpt", "sharedx"):
        (tmp_path / d).mkdir(parents=True)
    f = tmp_path / "mountinfo"
    f.write_text(MOUNTS.format(root=root))
    return root, str(f)


def test_the_longest_mount_point_by_whole_components_decides(table):
    root, mi = table
    assert filesystem_type(f"{root}/shared/ckpt", mi) == "nfs4"  # not made yet: its parent
    assert filesystem_type(f"{root}/shared/scratch/run", mi) == "xfs"  # a local disk inside
    assert filesystem_type(f"{root}/sharedx", mi) == "ext4"  # a prefix, not a parent
    assert filesystem_type(f"{root}/with space/ckpt", mi) == "fuse.gcsfuse"  # \040 escape
    assert filesystem_type(f"{root}/lus", mi) == "tmpfs"  # mounted over: the later one
    assert filesystem_type(root, mi) == "ext4"
    assert is_network_filesystem(f"{root}/shared/ckpt/step_1", mi)
    assert not is_network_filesystem(f"{root}/shared/scratch/run", mi)


def test_links_lone_roots_odd_lines_and_stacked_mounts(tmp_path):
    import os

    (tmp_path / "nfs").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "nfs")
    dev = os.stat(tmp_path).st_dev
    here = f"{os.major(dev)}:{os.minor(dev)}"
    root = str(tmp_path.resolve())
    table = tmp_path / "mountinfo"
    table.write_text(
        "garbage without a separator\n"
        "\n"
        "1 0 9:9 / / rw - nfs4 srv:/ rw\n"  # a lone root: every path is under it
        f"2 1 9:8 / {root}/nfs rw - lustre srv:/l rw\n"
        "3 1 9:7 / /only rw -\n"  # no fstype
    )
    assert filesystem_type("/usr", str(table)) == "nfs4"
    assert filesystem_type(tmp_path / "link" / "ckpt", str(table)) == "lustre"  # the link's target
    # A mount stacked over a longer one hides it: the path's own device decides.
    table.write_text(
        f"1 0 9:9 / / rw - ext4 /dev/sda rw\n"
        f"2 1 9:8 / {root}/nfs rw - nfs4 srv:/ rw\n"
        f"3 1 {here} / {root} rw - xfs /dev/sdb rw\n"
    )
    assert filesystem_type(tmp_path / "nfs" / "ckpt", str(table)) == "xfs"


def test_an_unreadable_table_knows_nothing(tmp_path):
    assert filesystem_type(tmp_path, str(tmp_path / "missing")) is None
    assert not is_network_filesystem(tmp_path, str(tmp_path / "missing"))


def test_read_once_defaults_on_for_object_stores_and_network_filesystems(table, monkeypatch):
    root, mi = table
    from snapshard.storage import mounts

    monkeypatch.setattr(mounts, "MOUNTINFO", mi)
    one = SingleProcessCoordinator()

    def on(location: str, enabled: bool | None = None) -> bool:
        return wanted(location, enabled, one, 5.0)

    assert on("s3://bucket/ckpt")
    assert on(f"{root}/shared/ckpt")
    assert not on(f"{root}/shared/scratch/run")
    assert not on(f"{root}/sharedx")
    assert on(f"{root}/sharedx", True)  # asked for: always as asked
    assert not on("s3://bucket/ckpt", False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the mount table is Linux's")
def test_this_machines_table_is_read(tmp_path):
    assert isinstance(filesystem_type(tmp_path), str)
