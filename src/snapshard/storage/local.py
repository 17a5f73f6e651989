"""POSIX filesystem storage: stage in a sibling directory, fsync everything, rename.

The checkpoint at D is staged in D.snapshard-tmp-<job>-<n> (the n-th save of that job to D,
or under its manager's directory;
a failed save removes it, one that was killed leaves it for the manager or the user to
remove, and readers never see it). Commit writes and fsyncs the manifest,
fsyncs the staged directories, renames the staging directory to D and fsyncs the parent, so
D either does not exist or is complete (atomic_rename.py). Its files are written and read by
local_files.py; the directory of several checkpoints is local_root.py's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import cpus
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
)
from ..format.naming import DATA_DIR, INDEX_DIR, MANIFEST_NAME, RETAINED_MARKER
from ..format.refs import check_checkpoint_name, split_ref_name
from .atomic_rename import fsync_dir, is_empty_dir, move_into_place
from .base import FileWriter, Storage
from .local_files import LocalFileWriter, is_regular, open_checkpoint_file, pread_into, read_fd
from .owner_records import ensure_owner_record, remove_own_record
from .stale_staging import DELETING_SUFFIX, STAGING_SUFFIX, sweep

DCP_METADATA = ".metadata"  # what PyTorch DCP's FileSystemWriter commits last


def _is_dcp_checkpoint(path: Path) -> bool:
    """`path` holds PyTorch DCP's own checkpoint: its `.metadata` file, no manifest.json."""
    return is_regular(path / DCP_METADATA) and not is_regular(path / MANIFEST_NAME)


def dcp_checkpoint_advice(url: str) -> str:
    """What reads a DCP-native checkpoint, for the errors that meet one."""
    return (
        f"it is a PyTorch DCP checkpoint (a {DCP_METADATA} file, no {MANIFEST_NAME}), which "
        "snapshard's loaders do not read: load it with DCP's own reader "
        "(dcp.load(state, checkpoint_id=path), or storage_reader=FileSystemReader(path)), or "
        f"convert it once: snapshard convert --trust-pickle {url} NEW_PATH"
    )


_FADV_SEQUENTIAL = getattr(os, "POSIX_FADV_SEQUENTIAL", None)
_FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)


class LocalStorage(Storage):
    """A checkpoint directory on a POSIX filesystem, staged in a sibling directory and
    committed by rename."""

    read_piece_bytes = 256 << 10
    # Evicted 2 GiB restores, 4 threads: 1.30 s in 16 MiB pieces against 1.69 s in 256 KiB
    # ones (medians of 12 paired rounds; design.md, "Restore, step by step").
    cold_read_piece_bytes = 16 << 20
    read_gap_bytes = 64 << 10

    def cached_read_threads(self) -> int:
        # Page-cache reads are memory copies: threads beyond this process's share of the
        # cores only contend (2 ranks on 2 cores: a torch restore took 0.145 s with 1 thread
        # each, 0.163 s with 4).
        return min(self.read_threads, cpus.share())

    def __init__(self, path: str | os.PathLike[str], *, referenced: bool = False):
        text = os.fspath(path)
        if not text:
            raise ValueError("empty checkpoint path")
        self.final = Path(os.path.abspath(text))
        # A checkpoint reached through another's references (a name read from a file) must
        # be a directory itself: a symbolic link there would lead outside the parent.
        self.referenced = referenced
        self.staging = self.final.with_name(self.final.name + STAGING_SUFFIX)
        self.url = str(self.final)
        self._fds: dict[str, int] = {}
        self._siblings: dict[str, LocalStorage] = {}
        self._lock = threading.Lock()

    def unportable(self) -> str | None:
        return None

    def __getstate__(self) -> dict[str, Any]:
        """Its paths, for a writer process (saving/writer_main.py): no open files, no lock,
        no commit guard (the writer asks the training process to run it)."""
        state = dict(self.__dict__)
        for handle in ("_fds", "_siblings", "_lock", "commit_guard"):
            state.pop(handle, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fds, self._siblings, self._lock = {}, {}, threading.Lock()

    def set_attempt(self, token: str) -> None:
        """Stage in `D.snapshard-tmp-<token>`: saves of different jobs (tokens) to one
        location never share, clean or commit each other's staging areas."""
        if token and not token.replace("-", "").isalnum():
            raise ValueError(f"invalid attempt token {token!r}")
        suffix = STAGING_SUFFIX + (f"-{token}" if token else "")
        self.staging = self.final.with_name(self.final.name + suffix)

    # ---- save side --------------------------------------------------------------------
    def prepare_staging(self) -> None:
        """Create the staging directory (every process of a save may call it) and record
        this process as one of its writers (owner_records.py), so that a later save can tell
        it from a killed save's; the commit removes those (see `_commit`)."""
        try:
            for sub in (DATA_DIR, INDEX_DIR):
                os.makedirs(self.staging / sub, exist_ok=True)
        except OSError as e:
            raise StorageError.wrap(e, "creation of the staging directory", self.staging) from e
        ensure_owner_record(self.staging)

    def open_writer(self, name: str) -> FileWriter:
        return LocalFileWriter(self.staging / name)

    def list_staging(self) -> dict[str, int]:
        out = {}
        try:
            for sub in (DATA_DIR, INDEX_DIR):
                d = self.staging / sub
                if d.is_dir():
                    for entry in os.scandir(d):
                        out[f"{sub}/{entry.name}"] = entry.stat(follow_symlinks=False).st_size
            for entry in os.scandir(self.staging) if self.staging.is_dir() else ():
                if entry.name not in (DATA_DIR, INDEX_DIR):
                    out[entry.name] = entry.stat(follow_symlinks=False).st_size
        except OSError as e:
            raise StorageError.wrap(e, "listing of the staging directory", self.staging) from e
        return out

    def read_staging(self, name: str) -> bytes:
        return self._read_whole(self.staging, name)

    def delete_staging_files(self, names: Sequence[str]) -> None:
        for n in names:
            p = self.staging / n
            try:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
            except OSError as e:
                raise StorageError.wrap(e, "deletion of", p) from e

    def commit(self, manifest: bytes, *, overwrite: bool) -> None:
        self._check_guard()
        try:
            self._commit(manifest, overwrite)
        except OSError as e:
            raise StorageError.wrap(e, "commit of", self.url) from e

    def _commit(self, manifest: bytes, overwrite: bool) -> None:
        self.write_bytes(MANIFEST_NAME, manifest)
        for sub in (DATA_DIR, INDEX_DIR):
            fsync_dir(self.staging / sub)
        fsync_dir(self.staging)
        vacant = not os.path.lexists(self.final) or self._check_replaceable(overwrite)
        # A path found vacant is only ever taken by a rename, which fails if it was filled
        # or taken meanwhile: never swapped with what arrived there.
        move_into_place(self.staging, self.final, replace=overwrite and not vacant)
        # What killed saves left beside it goes now, whichever wing saved: in the background
        # phase (never the blocking one), once per save, and never failing the commit.
        sweep(self.final.parent, keep=self.staging)

    def _occupied(self) -> str:
        """Why a save without overwrite cannot take the path: what is there."""
        if self.is_committed():
            return f"a checkpoint already exists at {self.url} (pass overwrite=True to replace it)"
        if self.final.is_symlink():
            return f"{self.url} is a symbolic link; save to the path it names, or another path"
        if not self.final.is_dir():
            return f"{self.url} exists and is not a directory; save to another path"
        if _is_dcp_checkpoint(self.final):
            return f"{self.url} holds a PyTorch DCP checkpoint; save to another path"
        if any(self.final.iterdir()):
            return (
                f"{self.url} is a non-empty directory that is not a snapshard checkpoint (it "
                "has no manifest.json); save to another path (overwrite=True does not replace it)"
            )
        return f"{self.url} was filled while the save was being written; save to another path"

    def _check_replaceable(self, overwrite: bool) -> bool:
        """Whether the commit may take the path, where something exists: an empty directory
        always (True: it holds nothing to lose), a committed checkpoint only with
        `overwrite` (False); never the working directory, a file, or a directory of other
        files (CheckpointExistsError)."""
        if self.final == Path(os.getcwd()) or self.final in Path(os.getcwd()).parents:
            raise CheckpointExistsError(
                f"{self.url} is the working directory or holds it; refusing to replace it"
            )
        if is_empty_dir(self.final):
            return True
        if not overwrite:
            raise CheckpointExistsError(self._occupied())
        if not self.final.is_dir():
            raise CheckpointExistsError(
                f"{self.url} exists and is not a directory; refusing to replace it"
            )
        if _is_dcp_checkpoint(self.final):
            raise CheckpointExistsError(
                f"{self.url} holds a PyTorch DCP checkpoint (a {DCP_METADATA} file, no "
                f"{MANIFEST_NAME}); refusing to replace it: save to another path, or remove it"
            )
        if any(self.final.iterdir()) and not is_regular(self.final / MANIFEST_NAME):
            raise CheckpointExistsError(
                f"{self.url} is a non-empty directory that is not a snapshard checkpoint; refusing to replace it"
            )
        return False

    def discard_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def discard_staging_if_empty(self) -> None:
        """Remove the staging directory if no other process's files or records remain in
        it (this process's owner record goes first: it writes no more there)."""
        remove_own_record(self.staging)
        for d in (self.staging / DATA_DIR, self.staging / INDEX_DIR, self.staging):
            with contextlib.suppress(OSError):  # not empty: another process's files remain
                os.rmdir(d)

    def staging_dirs(self) -> list[Path]:
        """The staging directories of saves to this checkpoint that have not committed
        (running, or stopped by a failure or a kill), of every job."""
        prefix = self.final.name + STAGING_SUFFIX
        try:
            entries = list(os.scandir(self.final.parent))
        except OSError:
            return []
        return sorted(Path(e.path) for e in entries if e.name.startswith(prefix) and e.is_dir())

    # ---- read side: only regular files inside the checkpoint ---------------------------
    def is_committed(self) -> bool:
        return is_regular(self.final / MANIFEST_NAME)

    def is_retained(self) -> bool:
        return is_regular(self.final / RETAINED_MARKER)

    def _read_whole(self, base: Path, name: str) -> bytes:
        try:
            fd = open_checkpoint_file(base, name, self.url, referenced=self.referenced)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.url}: file {name!r} is missing") from None
        return read_fd(fd, base / name)

    def read_manifest(self) -> bytes:
        try:
            fd = open_checkpoint_file(
                self.final, MANIFEST_NAME, self.url, referenced=self.referenced
            )
        except FileNotFoundError:
            staged = self.staging_dirs()
            if _is_dcp_checkpoint(self.final):
                why = dcp_checkpoint_advice(self.url)
            elif self.final.is_dir():
                why = "the directory has no manifest.json"
            elif staged:
                why = (
                    f"only an incomplete save is there ({staged[0].name}): it is still running "
                    "(wait for it: AsyncSave.wait(), the manager's wait_until_finished()), or "
                    "it stopped before its commit"
                )
            else:
                why = "the directory does not exist"
            raise CheckpointNotFoundError(f"no checkpoint at {self.url}: {why}") from None
        except NotADirectoryError:
            raise CheckpointNotFoundError(f"no checkpoint at {self.url}: it is a file") from None
        return read_fd(fd, self.final / MANIFEST_NAME)

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                try:
                    fd = open_checkpoint_file(
                        self.final, name, self.url, referenced=self.referenced
                    )
                except (FileNotFoundError, NotADirectoryError):
                    raise self._missing(name) from None
                if _FADV_SEQUENTIAL is not None:
                    # Restores read data files in long ranges, front to back: a larger
                    # readahead window. Evicted 2 GiB restores: 1.21 s against 1.39 s
                    # (median of 8 paired rounds; design.md, "Restore, step by step").
                    os.posix_fadvise(fd, 0, 0, _FADV_SEQUENTIAL)
                self._fds[name] = fd
            return fd

    def _missing(self, name: str) -> CheckpointNotFoundError | CorruptCheckpointError:
        """A committed file that is not there (see Storage.missing_file)."""
        try:
            manifest: bytes | None = (self.final / MANIFEST_NAME).read_bytes()
        except OSError:
            manifest = None
        return self.missing_file(name, manifest)

    def file_size(self, name: str) -> int:
        """The size of the committed file `name` (a referenced checkpoint's too), opened as
        every read opens it: CorruptCheckpointError where it is missing or refused."""
        ref = split_ref_name(name)
        if ref is not None:
            return self._sibling(ref[0]).file_size(ref[1])
        return os.fstat(self._fd(name)).st_size

    def in_memory(self, name: str, offset: int) -> bool | None:
        ref = split_ref_name(name)
        if ref is not None:
            return self._sibling(ref[0]).in_memory(ref[1], offset)
        if _RWF_NOWAIT is None:
            return None
        try:  # one byte, from the page cache or not at all
            return os.preadv(self._fd(name), [bytearray(1)], offset, _RWF_NOWAIT) == 1
        except BlockingIOError:
            return False
        except OSError:  # unsupported here (tmpfs, some network filesystems), or the read
            return None  # itself will say what is wrong

    def will_need(self, name: str, offset: int, nbytes: int) -> None:
        ref = split_ref_name(name)
        if ref is not None:
            self._sibling(ref[0]).will_need(ref[1], offset, nbytes)
        elif _FADV_WILLNEED is not None:
            with contextlib.suppress(OSError):  # a hint: the read reports what is wrong
                os.posix_fadvise(self._fd(name), offset, nbytes, _FADV_WILLNEED)

    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        ref = split_ref_name(name)
        if ref is not None:  # a file of a referenced checkpoint beside this one
            self._sibling(ref[0]).read_into(ref[1], offset, buffers)
            return
        pread_into(self._fd(name), offset, buffers, self.url, name)

    def delete(self) -> None:
        if not self.final.exists():
            return
        trash = self.final.with_name(self.final.name + DELETING_SUFFIX + uuid.uuid4().hex[:8])
        try:
            os.rename(self.final, trash)
            fsync_dir(self.final.parent)
        except OSError as e:
            raise StorageError.wrap(e, "deletion of", self.url) from e
        shutil.rmtree(trash, ignore_errors=True)

    def sibling(self, name: str) -> LocalStorage:
        """The checkpoint `name` beside this one, opened as a referenced checkpoint: its
        files are read, never followed through a symbolic link in its place."""
        return LocalStorage(self.final.parent / name, referenced=True)

    def _sibling(self, name: str) -> LocalStorage:
        """The referenced checkpoint `name` beside this one (its handles cached here)."""
        with self._lock:
            sib = self._siblings.get(name)
            if sib is None:
                check_checkpoint_name(name, self.url)
                sib = self.sibling(name)
                self._siblings[name] = sib
            return sib

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            siblings, self._siblings = list(self._siblings.values()), {}
        for sib in siblings:
            sib.close()
