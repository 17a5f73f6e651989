"""A local checkpoint's files, one at a time, at the level of system calls: written
(`LocalFileWriter`: writev, fsync at close), opened for reading (`open_checkpoint_file`: no
symbolic link followed, nothing but a regular file, never blocking) and read (`read_fd`
whole, `pread_into` into buffers).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CorruptCheckpointError, StorageError
from ..format.naming import DATA_DIR, INDEX_DIR
from .base import FileWriter, buffer_bytes, buffer_nbytes, slice_views
from .writeback import Writeback

if TYPE_CHECKING:
    from typing_extensions import Buffer

_IOV_MAX = 1024
_MAX_IO = 1 << 30


class LocalFileWriter(FileWriter):
    def __init__(self, path: Path):
        self.path = path
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError.wrap(e, "creation of", path) from e
        self.size = 0
        self.writeback = Writeback(self.fd)

    def write(self, data: memoryview) -> None:
        mv = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        try:
            while len(mv):
                n = os.write(self.fd, mv[:_MAX_IO])
                mv = mv[n:]
                self.size += n
            self.writeback.written(self.size)
        except OSError as e:
            raise StorageError.wrap(e, f"write (at byte {self.size}) of", self.path) from e

    def write_parts(self, parts: Sequence[Buffer]) -> None:
        """One system call per _IOV_MAX parts (writev), no copy of them joined."""
        try:
            for i in range(0, len(parts), _IOV_MAX):
                group = parts[i : i + _IOV_MAX]
                n = os.writev(self.fd, group)
                self.size += n
                for p in group:  # a short write (rare): the rest one by one
                    size = buffer_nbytes(p)
                    if n >= size:
                        n -= size
                        continue
                    self.write(buffer_bytes(p)[n:])
                    n = 0
            self.writeback.written(self.size)
        except OSError as e:
            raise StorageError.wrap(e, f"write (at byte {self.size}) of", self.path) from e

    def close(self) -> int:
        try:
            os.fsync(self.fd)
        except OSError as e:
            raise StorageError.wrap(e, "sync of", self.path) from e
        finally:
            os.close(self.fd)
        return self.size

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def open_checkpoint_file(base: Path, name: str, url: str, *, referenced: bool) -> int:
    """Open the checkpoint file `name` (`manifest.json`, `data/x`, `index/x`) for
    reading: no symlink followed below `base`, nothing but a regular file opened, never
    blocking (O_NONBLOCK, so a FIFO or device cannot hang the open)."""
    parts = name.split("/")
    if (
        len(parts) > 2
        or any(p in ("", ".", "..") for p in parts)
        or (len(parts) == 2 and parts[0] not in (DATA_DIR, INDEX_DIR))
    ):
        raise CorruptCheckpointError(
            f"{url}: file name {name!r} does not name a file of the checkpoint"
        )
    dir_fd = _open_base(base, name, url, referenced)
    try:
        if len(parts) == 2:
            sub = _open_subdirectory(dir_fd, parts[0], name, url)
            os.close(dir_fd)
            dir_fd = sub
        fd = _open_regular(dir_fd, parts[-1], name, url)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptCheckpointError(
                f"{url}: {name!r} is a symbolic link; refusing to follow it"
            ) from None
        if isinstance(e, FileNotFoundError | NotADirectoryError):
            raise
        raise StorageError.wrap(e, "open of", base / name) from e
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the check and the open
        os.close(fd)
        raise _not_regular(url, name, st.st_mode)
    return fd


def _open_base(base: Path, name: str, url: str, referenced: bool) -> int:
    """The checkpoint directory `base` opened (not through a symbolic link where it is a
    referenced checkpoint), to open `name` in."""
    nofollow = os.O_NOFOLLOW if referenced else 0
    try:
        return os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | nofollow)
    except OSError as e:
        if referenced and e.errno in (errno.ELOOP, errno.ENOTDIR) and base.is_symlink():
            raise CorruptCheckpointError(
                f"{url}: the referenced checkpoint is a symbolic link; refusing to "
                f"follow it to read {name!r}"
            ) from None
        if isinstance(e, FileNotFoundError | NotADirectoryError):
            raise
        raise StorageError.wrap(e, "open of", base) from e


def _open_subdirectory(dir_fd: int, sub: str, name: str, url: str) -> int:
    """The checkpoint's directory `sub` (data/, index/), never a symbolic link."""
    try:
        return os.open(
            sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CorruptCheckpointError(
                f"{url}: {sub}/ is not a directory of the checkpoint "
                f"(a symbolic link or another file); refusing to read {name!r}"
            ) from None
        raise


def _open_regular(dir_fd: int, file: str, name: str, url: str) -> int:
    """The regular file `file` in `dir_fd`, opened without following a link or blocking."""
    st = os.stat(file, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(url, name, st.st_mode)
    return os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(url: str, name: str, mode: int) -> CorruptCheckpointError:
    kind = next((what for test, what in _KINDS if test(mode)), "not a regular file")
    return CorruptCheckpointError(
        f"{url}: {name!r} is not a regular file ({kind}); refusing to read it"
    )


def read_fd(fd: int, path: Path) -> bytes:
    """All of the open file `fd` (closed after), a StorageError naming `path` if it fails."""
    try:
        parts: list[bytes] = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(parts)
            parts.append(b)
    except OSError as e:
        raise StorageError.wrap(e, "read of", path) from e
    finally:
        os.close(fd)


def pread_into(fd: int, offset: int, buffers: Sequence[memoryview], url: str, name: str) -> None:
    """Bytes [offset, offset + total) of the file `name` of checkpoint `url`, open as `fd`,
    into `buffers` in order: up to _IOV_MAX buffers per system call (preadv)."""
    bufs = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
    i = 0
    while i < len(bufs):
        batch = bufs[i : i + _IOV_MAX]
        want = sum(len(b) for b in batch)
        if want > _MAX_IO and len(batch) > 1:
            batch = bufs[i : i + 1]
            want = len(batch[0])
        done = 0
        while done < want:
            try:
                n = os.preadv(fd, slice_views(batch, done, want - done), offset + done)
            except OSError as e:
                raise StorageError.wrap(
                    e, f"read (at byte {offset + done}) of", Path(url, name)
                ) from e
            if n == 0:
                raise CorruptCheckpointError(
                    f"{url}: file {name!r} is truncated (wanted bytes up to {offset + want})"
                )
            done += n
        offset += want
        i += len(batch)


def is_regular(path: Path) -> bool:
    """`path` is a regular file itself (a symlink to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
