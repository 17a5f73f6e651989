"""Early writeback of a file being written, so that the disk works while we still copy.

A durable write is `write` calls, then `fsync`. Left alone, the kernel starts writing the
dirty pages back late, and the final fsync then waits for most of the file: the time of a
save is the copy into the page cache plus the disk's time. `Writeback` asks the kernel
(Linux `sync_file_range`) to start writing each window as soon as it is filled, and waits for
the window before the previous one, so copying and the disk overlap and the dirty pages a
writer holds stay bounded. It changes no guarantee: durability still comes from the fsync
at close. Where the call does not exist (other systems), it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Any

WINDOW = 64 << 20  # bytes written between two writeback requests

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


def _sync_file_range() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


class Writeback:
    """Tracks one file descriptor's written bytes and requests their writeback."""

    def __init__(self, fd: int):
        self.fd = fd
        self.requested = 0  # bytes [0, requested) have been handed to the disk
        self.waited = 0  # and [0, waited) are on it
        self.enabled = _SYNC_FILE_RANGE is not None

    def written(self, size: int) -> None:
        """The file now holds `size` bytes: start writeback of every full window since the
        last request, then wait for what lies more than one window behind."""
        if not self.enabled or size - self.requested < WINDOW:
            return
        start, self.requested = self.requested, size
        self._call(start, size - start, _WRITE)
        behind = start - WINDOW
        if behind > self.waited:
            self._call(self.waited, behind - self.waited, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
            self.waited = behind

    def _call(self, offset: int, nbytes: int, flags: int) -> None:
        assert _SYNC_FILE_RANGE is not None
        if _SYNC_FILE_RANGE(self.fd, offset, nbytes, flags) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.EIO, errno.ENOSPC):
            raise OSError(err, os.strerror(err))
        self.enabled = False  # not supported for this file (e.g. ENOSYS, ESPIPE, EINVAL)
