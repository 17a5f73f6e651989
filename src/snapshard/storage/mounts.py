"""Which filesystem a local path lives on, so that defaults can tell a disk of this machine
from storage every host of the job shares over the network (where, as on an object store,
each byte a process reads again crosses the network and loads a shared server).

Linux only (the mount table of `/proc/self/mountinfo`); elsewhere, and for a filesystem
the table does not name or NETWORK_FILESYSTEMS does not list, the path counts as local.
"""

from __future__ import annotations

import os
import re

MOUNTINFO = "/proc/self/mountinfo"

# Filesystems served over the network to many hosts (`fstype` of the mount table; FUSE
# mounts are `fuse.<subtype>`). Not 9p: WSL2 and gVisor serve the machine's own disk so.
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs",
        "beegfs", "wekafs", "afs", "orangefs", "pvfs2", "gfs2", "ocfs2",
        "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.goofys", "fuse.juicefs",
        "fuse.glusterfs", "fuse.ceph-fuse", "fuse.blobfuse2", "fuse.rclone", "fuse.sshfs",
    }
)  # fmt: skip

_ESCAPE = re.compile(rb"\\([0-7]{3})")


def _unescape(field: bytes) -> str:
    """A mount point as the mount table writes it (space, tab, newline and backslash as
    octal escapes; the bytes of the path as the kernel has them)."""
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def filesystem_type(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The `fstype` of the mount that holds `path` (for a path not yet made, its nearest
    existing ancestor), or None where the mount table (`mountinfo`, by default MOUNTINFO)
    cannot be read. Among the mounts whose point is a prefix of the path by whole
    components, those of the path's device (`st_dev`) come first, which sees through
    mounts stacked over others; then the longest point, the later line for equal ones."""
    try:
        with open(mountinfo or MOUNTINFO, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError:
        return None
    where = os.path.abspath(os.fspath(path))
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    where = os.path.realpath(where)
    try:
        dev = os.stat(where).st_dev
        device = f"{os.major(dev)}:{os.minor(dev)}"
    except OSError:
        device = None
    best: tuple[bool, int] | None = None
    kind = None
    for line in lines:
        head, sep, tail = line.partition(b" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or not rest:
            continue
        point = _unescape(fields[4])
        if not (where == point or where.startswith(point.rstrip("/") + "/")):
            continue
        rank = (fields[2].decode(errors="replace") == device, len(point))
        if best is None or rank >= best:
            best, kind = rank, os.fsdecode(rest[0])
    return kind


def is_network_filesystem(path: str | os.PathLike[str], mountinfo: str | None = None) -> bool:
    """Whether `path` lives on a filesystem served over the network (NETWORK_FILESYSTEMS)."""
    return filesystem_type(path, mountinfo) in NETWORK_FILESYSTEMS
