"""POSIX filesystem storage: stage in a sibling directory, fsync everything, rename.

The checkpoint at D is staged in D.snapshard-tmp. Commit writes and fsyncs the manifest,
fsyncs the staged directories, renames the staging directory to D and fsyncs the parent, so
D either does not exist or is complete. Overwriting swaps the two directories atomically
(renameat2 RENAME_EXCHANGE) where the kernel offers it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
)
from ..format.manifest import DATA_DIR, INDEX_DIR, MANIFEST_NAME
from ..format.refs import check_checkpoint_name, split_ref_name
from .base import CheckpointRoot, FileWriter, Storage

STAGING_SUFFIX = ".snapshard-tmp"
DELETING_SUFFIX = ".snapshard-deleting"
_IOV_MAX = 1024
_MAX_IO = 1 << 30
_RENAME_EXCHANGE = 2


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
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


class LocalFileWriter(FileWriter):
    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self.size = 0

    def write(self, data: memoryview) -> None:
        mv = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while len(mv):
            n = os.write(self.fd, mv[:_MAX_IO])
            mv = mv[n:]
            self.size += n

    def close(self) -> int:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        return self.size

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class LocalStorage(Storage):
    def __init__(self, path: str | os.PathLike[str]):
        self.final = Path(os.path.abspath(os.fspath(path)))
        self.staging = self.final.with_name(self.final.name + STAGING_SUFFIX)
        self.url = str(self.final)
        self._fds: dict[str, int] = {}
        self._siblings: dict[str, LocalStorage] = {}
        self._lock = threading.Lock()

    # ---- save side --------------------------------------------------------------------
    def prepare_staging(self) -> None:
        for sub in (DATA_DIR, INDEX_DIR):
            os.makedirs(self.staging / sub, exist_ok=True)

    def open_writer(self, name: str) -> FileWriter:
        return LocalFileWriter(self.staging / name)

    def list_staging(self) -> dict[str, int]:
        out = {}
        for sub in (DATA_DIR, INDEX_DIR):
            d = self.staging / sub
            if d.is_dir():
                for entry in os.scandir(d):
                    out[f"{sub}/{entry.name}"] = entry.stat().st_size
        for entry in os.scandir(self.staging) if self.staging.is_dir() else ():
            if entry.name not in (DATA_DIR, INDEX_DIR):
                out[entry.name] = entry.stat().st_size
        return out

    def read_staging(self, name: str) -> bytes:
        return (self.staging / name).read_bytes()

    def delete_staging_files(self, names: Sequence[str]) -> None:
        for n in names:
            p = self.staging / n
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)

    def commit(self, manifest: bytes, *, overwrite: bool) -> None:
        self.write_bytes(MANIFEST_NAME, manifest)
        for sub in (DATA_DIR, INDEX_DIR):
            fsync_dir(self.staging / sub)
        fsync_dir(self.staging)
        if self.final.exists():
            if not overwrite:
                raise CheckpointExistsError(
                    f"a checkpoint already exists at {self.url} (pass overwrite=True to replace it)"
                )
            self._check_replaceable()
            if not _exchange(self.staging, self.final):
                old = self.final.with_name(self.final.name + DELETING_SUFFIX + uuid.uuid4().hex[:8])
                os.rename(self.final, old)
                os.rename(self.staging, self.final)
                fsync_dir(self.final.parent)
                shutil.rmtree(old, ignore_errors=True)
                return
            fsync_dir(self.final.parent)
            shutil.rmtree(self.staging, ignore_errors=True)
            return
        try:
            os.rename(self.staging, self.final)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise CheckpointExistsError(
                    f"a checkpoint appeared at {self.url} during the save"
                ) from None
            raise
        fsync_dir(self.final.parent)

    def _check_replaceable(self) -> None:
        if not self.final.is_dir():
            raise CheckpointExistsError(
                f"{self.url} exists and is not a directory; refusing to replace it"
            )
        if any(self.final.iterdir()) and not (self.final / MANIFEST_NAME).is_file():
            raise CheckpointExistsError(
                f"{self.url} is a non-empty directory that is not a snapshard checkpoint; refusing to replace it"
            )

    def discard_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    # ---- read side --------------------------------------------------------------------
    def is_committed(self) -> bool:
        return (self.final / MANIFEST_NAME).is_file()

    def read_manifest(self) -> bytes:
        try:
            return (self.final / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            if self.final.is_dir():
                why = "the directory has no manifest.json"
            elif self.staging.is_dir():
                why = "only an incomplete save is there"
            else:
                why = "the directory does not exist"
            raise CheckpointNotFoundError(f"no checkpoint at {self.url}: {why}") from None
        except NotADirectoryError:
            raise CheckpointNotFoundError(f"no checkpoint at {self.url}: it is a file") from None

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                try:
                    fd = os.open(self.final / name, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"{self.url}: data file {name!r} is missing"
                    ) from None
                self._fds[name] = fd
            return fd

    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        ref = split_ref_name(name)
        if ref is not None:  # a file of a referenced checkpoint beside this one
            self._sibling(ref[0]).read_into(ref[1], offset, buffers)
            return
        fd = self._fd(name)
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
                n = os.preadv(fd, _skip(batch, done), offset + done)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"{self.url}: file {name!r} is truncated (wanted bytes up to {offset + want})"
                    )
                done += n
            offset += want
            i += len(batch)

    def delete(self) -> None:
        if not self.final.exists():
            return
        trash = self.final.with_name(self.final.name + DELETING_SUFFIX + uuid.uuid4().hex[:8])
        try:
            os.rename(self.final, trash)
        except OSError as e:
            raise StorageError(f"cannot delete {self.url}: {e}") from e
        fsync_dir(self.final.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def _sibling(self, name: str) -> LocalStorage:
        """The referenced checkpoint `name` beside this one (its handles cached here)."""
        with self._lock:
            sib = self._siblings.get(name)
            if sib is None:
                check_checkpoint_name(name, self.url)
                sib = self._siblings[name] = LocalStorage(self.final.parent / name)
            return sib

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            siblings, self._siblings = list(self._siblings.values()), {}
        for sib in siblings:
            sib.close()


class LocalRoot(CheckpointRoot):
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.url = str(self.path)

    def list(self) -> dict[str, bool]:
        out: dict[str, bool] = {}
        if not self.path.is_dir():
            return out
        for entry in os.scandir(self.path):
            if not entry.is_dir():
                continue
            name = entry.name
            for suffix in (STAGING_SUFFIX, DELETING_SUFFIX):
                if suffix in name:
                    base = name[: name.index(suffix)]
                    out.setdefault(base, False)
                    break
            else:
                out[name] = (Path(entry.path) / MANIFEST_NAME).is_file()
        return out

    def child(self, name: str) -> Storage:
        return LocalStorage(self.path / name)

    def remove_incomplete(self, name: str) -> None:
        for entry in os.scandir(self.path) if self.path.is_dir() else ():
            if entry.name.startswith(name) and entry.name[len(name) :].startswith(
                (STAGING_SUFFIX, DELETING_SUFFIX)
            ):
                shutil.rmtree(entry.path, ignore_errors=True)
        target = self.path / name
        if target.is_dir() and not (target / MANIFEST_NAME).is_file():
            shutil.rmtree(target, ignore_errors=True)


def _skip(buffers: list[memoryview], n: int) -> list[memoryview]:
    """The buffers with their first n bytes dropped (after a short read)."""
    out = []
    for b in buffers:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:])
        n = 0
    return out
