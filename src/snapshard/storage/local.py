"""POSIX filesystem storage: stage in a sibling directory, fsync everything, rename.

The checkpoint at D is staged in D.snapshard-tmp-<job>-<n> (the n-th save of that job to D,
or under its manager's directory;
a failed save removes it, one that was killed leaves it for the manager or the user to
remove, and readers never see it). Commit writes and fsyncs the manifest,
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
import stat
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cpus
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
)
from ..format.naming import DATA_DIR, INDEX_DIR, MANIFEST_NAME
from ..format.refs import check_checkpoint_name, split_ref_name
from . import stale_staging
from .base import CheckpointRoot, FileWriter, Storage, buffer_bytes, buffer_nbytes, slice_views
from .lease import LEASE_DIR, LeaseFiles, LocalLeaseFiles
from .stale_staging import DELETING_SUFFIX, STAGING_SUFFIX
from .writeback import Writeback

if TYPE_CHECKING:
    from typing_extensions import Buffer

DCP_METADATA = ".metadata"  # what PyTorch DCP's FileSystemWriter commits last
_IOV_MAX = 1024
_MAX_IO = 1 << 30
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
    if not os.path.lexists(final) or (staging.is_dir() and _is_empty_dir(final)):
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


def _is_empty_dir(path: Path) -> bool:
    """`path` is a directory itself (not a symbolic link to one) with no entries."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def _is_dcp_checkpoint(path: Path) -> bool:
    """`path` holds PyTorch DCP's own checkpoint: its `.metadata` file, no manifest.json."""
    return _is_regular(path / DCP_METADATA) and not _is_regular(path / MANIFEST_NAME)


def dcp_checkpoint_advice(url: str) -> str:
    """What reads a DCP-native checkpoint, for the errors that meet one."""
    return (
        f"it is a PyTorch DCP checkpoint (a {DCP_METADATA} file, no {MANIFEST_NAME}), which "
        "snapshard's loaders do not read: load it with DCP's own reader "
        "(dcp.load(state, checkpoint_id=path), or storage_reader=FileSystemReader(path)), or "
        f"convert it once: snapshard convert --trust-pickle {url} NEW_PATH"
    )


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


def _is_regular(path: Path) -> bool:
    """`path` is a regular file itself (a symlink to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_fd(fd: int, path: Path) -> bytes:
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
        this process as one of its writers (stale_staging.py), so that a later save can tell
        it from a killed save's; the commit removes those (see `_commit`)."""
        try:
            for sub in (DATA_DIR, INDEX_DIR):
                os.makedirs(self.staging / sub, exist_ok=True)
        except OSError as e:
            raise StorageError.wrap(e, "creation of the staging directory", self.staging) from e
        stale_staging.ensure_owner_record(self.staging)

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
        stale_staging.sweep(self.final.parent, keep=self.staging)

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
        if _is_empty_dir(self.final):
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
        if any(self.final.iterdir()) and not _is_regular(self.final / MANIFEST_NAME):
            raise CheckpointExistsError(
                f"{self.url} is a non-empty directory that is not a snapshard checkpoint; refusing to replace it"
            )
        return False

    def discard_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def discard_staging_if_empty(self) -> None:
        """Remove the staging directory if no other process's files or records remain in
        it (this process's owner record goes first: it writes no more there)."""
        stale_staging.remove_own_record(self.staging)
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
        return _is_regular(self.final / MANIFEST_NAME)

    def _open(self, base: Path, name: str) -> int:
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
                f"{self.url}: file name {name!r} does not name a file of the checkpoint"
            )
        dir_fd = self._open_base(base, name)
        try:
            if len(parts) == 2:
                sub = self._open_subdirectory(dir_fd, parts[0], name)
                os.close(dir_fd)
                dir_fd = sub
            fd = self._open_regular(dir_fd, parts[-1], name)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CorruptCheckpointError(
                    f"{self.url}: {name!r} is a symbolic link; refusing to follow it"
                ) from None
            if isinstance(e, FileNotFoundError | NotADirectoryError):
                raise
            raise StorageError.wrap(e, "open of", base / name) from e
        finally:
            os.close(dir_fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced between the check and the open
            os.close(fd)
            raise CorruptCheckpointError(
                f"{self.url}: {name!r} is not a regular file ({_kind(st.st_mode)}); refusing to read it"
            )
        return fd

    def _open_base(self, base: Path, name: str) -> int:
        """The checkpoint directory `base` opened (not through a symbolic link where it is a
        referenced checkpoint), to open `name` in."""
        nofollow = os.O_NOFOLLOW if self.referenced else 0
        try:
            return os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | nofollow)
        except OSError as e:
            if self.referenced and e.errno in (errno.ELOOP, errno.ENOTDIR) and base.is_symlink():
                raise CorruptCheckpointError(
                    f"{self.url}: the referenced checkpoint is a symbolic link; refusing to "
                    f"follow it to read {name!r}"
                ) from None
            if isinstance(e, FileNotFoundError | NotADirectoryError):
                raise
            raise StorageError.wrap(e, "open of", base) from e

    def _open_subdirectory(self, dir_fd: int, sub: str, name: str) -> int:
        """The checkpoint's directory `sub` (data/, index/), never a symbolic link."""
        try:
            return os.open(
                sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
            )
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CorruptCheckpointError(
                    f"{self.url}: {sub}/ is not a directory of the checkpoint "
                    f"(a symbolic link or another file); refusing to read {name!r}"
                ) from None
            raise

    def _open_regular(self, dir_fd: int, file: str, name: str) -> int:
        """The regular file `file` in `dir_fd`, opened without following a link or blocking."""
        st = os.stat(file, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"{self.url}: {name!r} is not a regular file ({_kind(st.st_mode)}); refusing to read it"
            )
        return os.open(
            file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )

    def _read_whole(self, base: Path, name: str) -> bytes:
        try:
            fd = self._open(base, name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{self.url}: file {name!r} is missing") from None
        return _read_fd(fd, base / name)

    def read_manifest(self) -> bytes:
        try:
            fd = self._open(self.final, MANIFEST_NAME)
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
        return _read_fd(fd, self.final / MANIFEST_NAME)

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                try:
                    fd = self._open(self.final, name)
                except (FileNotFoundError, NotADirectoryError):
                    raise CorruptCheckpointError(
                        f"{self.url}: data file {name!r} is missing"
                    ) from None
                if _FADV_SEQUENTIAL is not None:
                    # Restores read data files in long ranges, front to back: a larger
                    # readahead window. Evicted 2 GiB restores: 1.21 s against 1.39 s
                    # (median of 8 paired rounds; design.md, "Restore, step by step").
                    os.posix_fadvise(fd, 0, 0, _FADV_SEQUENTIAL)
                self._fds[name] = fd
            return fd

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
                try:
                    n = os.preadv(fd, slice_views(batch, done, want - done), offset + done)
                except OSError as e:
                    raise StorageError.wrap(
                        e, f"read (at byte {offset + done}) of", self.final / name
                    ) from e
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


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


class LocalRoot(CheckpointRoot):
    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.url = str(self.path)

    def list(self) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for entry in self._entries():
            if not entry.is_dir() or entry.name == LEASE_DIR:
                continue
            found = stale_staging.classify(entry.name)
            if found is not None:
                out.setdefault(found[0], False)
            else:
                out[entry.name] = _is_regular(Path(entry.path) / MANIFEST_NAME)
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
        if target.is_dir() and not _is_regular(target / MANIFEST_NAME):
            shutil.rmtree(target, ignore_errors=True)
