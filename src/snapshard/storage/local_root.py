"""The directory of several local checkpoints (a manager's): listing them, removing the
incomplete, and the files of its writer lease (`.snapshard-writer/`, see lease.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from ..errors import StorageError
from ..format.naming import MANIFEST_NAME
from .base import CheckpointRoot, Storage
from .lease import LEASE_DIR, LeaseFiles
from .local import LocalStorage
from .local_files import is_regular
from .stale_staging import DELETING_SUFFIX, STAGING_SUFFIX, classify


class LocalRoot(CheckpointRoot):
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.url = str(self.path)

    def list(self) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for entry in self._entries():
            if not entry.is_dir() or entry.name == LEASE_DIR:
                continue
            found = classify(entry.name)
            if found is not None:
                out.setdefault(found[0], False)
            else:
                out[entry.name] = is_regular(Path(entry.path) / MANIFEST_NAME)
        return out

    def _entries(self) -> Sequence[os.DirEntry[str]]:
        try:
            return list(os.scandir(self.path)) if self.path.is_dir() else []
        except OSError as e:
            raise StorageError.wrap(e, "listing of", self.path) from e

    def child(self, name: str) -> Storage:
        return LocalStorage(self.path / name)

    def lease_files(self) -> LeaseFiles:
        return LocalLeaseFiles(self.path)

    def remove_incomplete(self, name: str) -> None:
        if name == LEASE_DIR:
            return
        for entry in self._entries():
            if entry.name.startswith(name) and entry.name[len(name) :].startswith(
                (STAGING_SUFFIX, DELETING_SUFFIX)
            ):
                shutil.rmtree(entry.path, ignore_errors=True)
        target = self.path / name
        if target.is_dir() and not is_regular(target / MANIFEST_NAME):
            shutil.rmtree(target, ignore_errors=True)


class LocalLeaseFiles(LeaseFiles):
    def __init__(self, root: Path):
        self.dir = root / LEASE_DIR
        self.where = str(self.dir)

    def names(self) -> list[str]:
        try:
            return [e.name for e in os.scandir(self.dir)]
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError.wrap(e, "listing of the writer lease", self.dir) from e

    def read(self, name: str) -> bytes | None:
        try:
            return (self.dir / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError.wrap(e, "read of the writer lease", self.dir / name) from e

    def _tmp(self, data: bytes) -> Path:
        tmp = self.dir / f".tmp-{uuid.uuid4().hex}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        for _ in range(5):  # the directory is removed when the last lease goes
            os.makedirs(self.dir, exist_ok=True)
            try:
                fd = os.open(tmp, flags, 0o644)
                break
            except FileNotFoundError:
                continue
        else:
            fd = os.open(tmp, flags, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def create(self, name: str, data: bytes) -> bool:
        try:
            tmp = self._tmp(data)
            try:
                os.link(tmp, self.dir / name)
            except FileExistsError:
                return False
            finally:
                with contextlib.suppress(OSError):  # a leftover temporary file is harmless
                    tmp.unlink(missing_ok=True)
        except OSError as e:
            raise StorageError.wrap(e, "creation of the writer lease", self.dir / name) from e
        return True

    def replace(self, name: str, data: bytes) -> None:
        try:
            os.replace(self._tmp(data), self.dir / name)
        except OSError as e:
            raise StorageError.wrap(e, "heartbeat of the writer lease", self.dir / name) from e

    def remove(self, name: str) -> None:
        try:
            (self.dir / name).unlink(missing_ok=True)
        except OSError as e:
            raise StorageError.wrap(e, "removal of the writer lease", self.dir / name) from e
        with contextlib.suppress(OSError):
            now = time.time()
            for entry in os.scandir(self.dir):
                # A heartbeat's or a creation's temporary file, left by a writer killed
                # between its write and its rename (a live one's lasts milliseconds).
                old = now - entry.stat().st_mtime > _TMP_STALE_S
                if entry.name.startswith(".tmp-") and old:
                    os.unlink(entry.path)
        with contextlib.suppress(OSError):  # not empty: another lease is there
            self.dir.rmdir()


_TMP_STALE_S = 30.0
