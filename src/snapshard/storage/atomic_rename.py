"""Durable, atomic renames on a local filesystem (`move_into_place`, `fsync_dir`): what was
staged appears at its final path in one step, whole or not at all, and stays there after a
crash. Overwriting swaps the two directories atomically (renameat2 RENAME_EXCHANGE) where
the kernel offers it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import uuid
from pathlib import Path

from ..errors import CheckpointExistsError
from .stale_staging import DELETING_SUFFIX

_RENAME_EXCHANGE = 2


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the kernel or libc cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def move_into_place(staging: Path, final: Path, *, replace: bool) -> None:
    """Make `staging` (a file or a directory, its contents already synced) appear at
    `final` in one step: the atomic local commit of checkpoints, exports and local-tier
    copies. An absent `final`, or an empty directory there (it holds nothing to lose), is
    taken by one rename(2), which the kernel refuses if the directory was filled or the path
    taken meanwhile: CheckpointExistsError, nothing replaced. Anything else at `final` is
    replaced whole when `replace`, else CheckpointExistsError: a file by a file with one
    rename(2); where either is a directory (a checkpoint, or a directory replacing a file
    such as Lightning's own `.ckpt`), the two are swapped with renameat2(RENAME_EXCHANGE)
    where the kernel has it, else the old one is moved aside under DELETING_SUFFIX first, so
    it is never seen half-deleted; then the old one is deleted."""
    if not os.path.lexists(final) or (staging.is_dir() and is_empty_dir(final)):
        _rename_onto_vacant(staging, final)
        return
    if not replace:
        raise _appeared(final)
    if not staging.is_dir() and not (final.is_dir() and not final.is_symlink()):
        os.replace(staging, final)
        fsync_dir(final.parent)
        return
    if _exchange(staging, final):
        fsync_dir(final.parent)
        _remove(staging)  # the old one, now at the staging name
        return
    old = final.with_name(final.name + DELETING_SUFFIX + uuid.uuid4().hex[:8])
    os.rename(final, old)
    os.rename(staging, final)
    fsync_dir(final.parent)
    _remove(old)


def _remove(path: Path) -> None:
    """Delete a replaced file or directory (best effort: the new one is in place)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _rename_onto_vacant(staging: Path, final: Path) -> None:
    """rename(2) of `staging` onto an absent path or an empty directory: atomic, and it never
    replaces a directory that holds anything (ENOTEMPTY/EEXIST) or a directory by a file
    (EISDIR) or a file by a directory (ENOTDIR)."""
    try:
        os.rename(staging, final)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
            raise _appeared(final) from None
        raise
    fsync_dir(final.parent)


def _appeared(final: Path) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{final} appeared, or was filled, while it was being written; nothing was replaced"
    )


def is_empty_dir(path: Path) -> bool:
    """`path` is a directory itself (not a symbolic link to one) with no entries."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False
