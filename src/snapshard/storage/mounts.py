"""Which filesystem a local path lives on, so that defaults can tell a disk of this machine
from storage every host of the job shares over the network (where, as on an object store,
each byte a process reads again crosses the network and loads a shared server).

Linux only (the mount table of `/proc/self/mountinfo`); elsewhere the type is unknown.
"""

from __future__ import annotations

import os
import re

MOUNTINFO = "/proc/self/mountinfo"

# Filesystems served over the network to many hosts (`fstype` of the mount table; FUSE
# mounts are `fuse.<subtype>`).
NETWORK_FILESYSTEMS = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs",
        "beegfs", "wekafs", "9p", "afs", "orangefs", "pvfs2", "gfs2", "ocfs2",
        "fuse.gcsfuse", "fuse.s3fs", "fuse.mountpoint-s3", "fuse.goofys", "fuse.juicefs",
        "fuse.glusterfs", "fuse.ceph-fuse", "fuse.blobfuse2", "fuse.rclone", "fuse.sshfs",
    }
)  # fmt: skip

_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """A mount point as the mount table writes it (space, tab, newline and backslash as
    octal escapes)."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The `fstype` of the mount that holds `path` (the mount point that is its longest
    prefix, by whole components; the nearest existing ancestor of a path not yet made),
    or None where the mount table (`mountinfo`, by default MOUNTINFO) cannot be read."""
    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    where = os.path.abspath(os.fspath(path))
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    where = os.path.realpath(where)
    best, kind = -1, None
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or not rest:
            continue
        point = _unescape(fields[4])
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:  # later mounts over the same point win
            best, kind = len(point), rest[0]
    return kind


def is_network_filesystem(path: str | os.PathLike[str], mountinfo: str | None = None) -> bool:
    """Whether `path` lives on a filesystem served over the network (NETWORK_FILESYSTEMS)."""
    return filesystem_type(path, mountinfo) in NETWORK_FILESYSTEMS
