"""The storage interface: one checkpoint location, its files, and its commit protocol.

A save writes into a *staging* area that readers never see, then `commit` makes the whole
checkpoint visible at once (a rename on a filesystem, a commit marker on an object store).
Readers go through `read_manifest` and `read_into` only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.naming import file_nonce
from .location import parse_location

# The package's `storage_for`, which knows every backend: the backends import this module,
# so it cannot import them; the package hands its opener over when it is imported
# (`set_opener`), for the default `Storage.sibling`.
_opener: Callable[[str], Storage] | None = None


def set_opener(opener: Callable[[str], Storage]) -> None:
    global _opener
    _opener = opener


if TYPE_CHECKING:
    from typing_extensions import Buffer  # (typing's own from Python 3.12)

    from .lease import LeaseFiles


def deleted_while_read(url: str, name: str) -> CheckpointNotFoundError:
    """The error of a committed file gone with its checkpoint's commit (its manifest, its
    marker): deleted by a writer's retention while this reader read it, not damage."""
    return CheckpointNotFoundError(
        f"{url}: the checkpoint was deleted while it was read (file {name!r} is gone); a "
        "CheckpointManager's retention deletes old steps: read a kept one"
    )


def buffer_nbytes(p: Buffer) -> int:
    """How many bytes a buffer holds (bytes, memoryviews, NumPy arrays and scalars)."""
    n = getattr(p, "nbytes", None)
    return len(p) if n is None else int(n)  # type: ignore[arg-type]


def buffer_bytes(p: Buffer) -> memoryview:
    """A buffer's bytes as a flat memoryview of unsigned bytes (`memoryview(p)` itself
    fails for NumPy dtypes the buffer protocol cannot describe, such as bfloat16)."""
    return memoryview(np.frombuffer(p, np.uint8))  # type: ignore[call-overload]


def slice_views(views: list[memoryview], pos: int, n: int) -> list[memoryview]:
    """The views covering bytes [pos, pos + n) of the concatenation of `views`."""
    out = []
    for v in views:
        if pos >= len(v):
            pos -= len(v)
            continue
        take = min(len(v) - pos, n)
        out.append(v[pos : pos + take])
        n -= take
        pos = 0
        if n == 0:
            break
    return out


class FileWriter(ABC):
    """A file being written in the staging area. `close` makes it durable."""

    @abstractmethod
    def write(self, data: memoryview) -> None:
        """Append the bytes; the caller may change or reuse `data` once this returns."""

    def write_kept(self, data: memoryview) -> None:
        """Append bytes that the caller leaves unchanged until the writer is closed or
        aborted: a writer may keep them instead of a copy (an object-store file that goes
        up in one request). By default, `write`."""
        self.write(data)

    def write_parts(self, parts: Sequence[Buffer]) -> None:
        """Append the bytes of `parts` back to back (many small buffers: a run of small
        chunks and their checksums); the caller may change or reuse them once this
        returns. By default, one `write_kept` of their bytes joined (a new buffer nobody
        else holds)."""
        self.write_kept(memoryview(b"".join(parts)))

    @abstractmethod
    def close(self) -> int:
        """Flush and sync the file; returns its size."""

    @abstractmethod
    def abort(self) -> None:
        """Give up on the file (best effort, never raises)."""


class Storage(ABC):
    """A checkpoint location. File names are relative ('data/p00000-…-0.bin', 'index/…')."""

    url: str
    # Called by `commit` before anything becomes visible (a CheckpointManager checks its
    # writer lease there); raising aborts the commit.
    commit_guard: Callable[[], None] | None = None
    # Verified reads larger than this are split into pieces of about this size, each checked
    # right after it lands, while it is still in the CPU's cache (local files, where a
    # request costs a system call). None: one request per range (object stores, where each
    # costs a round trip).
    read_piece_bytes: int | None = None
    # The piece size of a verified read whose bytes are not in memory yet (`in_memory`):
    # the device then streams large requests faster than cache-sized ones.
    cold_read_piece_bytes: int | None = None
    # Reads of one chunk whose byte runs are closer than this merge into one read, the bytes
    # between them read and dropped (the default of `max_gap` in every load): a request
    # here costs about as much as reading this many bytes more.
    read_gap_bytes: int = 4096
    # Read threads of a restore that does not set ReadOptions.threads: each thread keeps one
    # request in flight, which bounds reads that wait on the network or the device.
    read_threads: int = 4
    # A save cuts each process's data into files of at most `data_file_bytes` where its
    # items allow (chunk_files.cut_files; an object store sends such a file in one request),
    # and each of its writers has as many files in flight as `upload_bytes_per_writer` holds.
    # None: as many files as writers, all at once.
    data_file_bytes: int | None = None
    upload_bytes_per_writer: int | None = None

    def cached_read_threads(self) -> int:
        """Read threads for bytes already in memory (`in_memory`), which cost CPU rather
        than waiting."""
        return self.read_threads

    def in_memory(self, name: str, offset: int) -> bool | None:
        """Whether byte `offset` of file `name` can be read without waiting for the device
        (in the OS's page cache); None where the storage cannot tell."""
        return None

    def will_need(self, name: str, offset: int, nbytes: int) -> None:  # noqa: B027
        """Start fetching bytes [offset, offset + nbytes) of file `name` from the device
        without waiting for them (a hint; nothing where the storage has no such means)."""

    def unportable(self) -> str | None:
        """Why this storage cannot be handed to a writer process (saving/writer_process.py),
        or None: it then pickles to a copy that reaches the same location from there."""
        return "a writer process writes to local filesystems and object stores only"

    def requests_made(self) -> Any:
        """What this copy counted of its requests (an object store's RequestStats), for a
        writer process to hand back to the training process's copy; None: nothing counted."""
        return None

    def add_requests(self, made: Any) -> None:  # noqa: B027 - nothing counted by default
        """Count `made` (another copy's `requests_made()`) as this storage's own."""

    def sibling(self, name: str) -> Storage:
        """The checkpoint `name` beside this one: same parent, same store (a base or a
        referenced checkpoint of an incremental save). Backends with options or handles to
        share override it."""
        if _opener is None:  # (set as the package is imported, before any Storage exists)
            raise RuntimeError("snapshard.storage is not initialised")
        return _opener(parse_location(self.url).sibling(name))

    def _check_guard(self) -> None:
        if self.commit_guard is not None:
            self.commit_guard()

    # ---- save side: the staging area -------------------------------------------------
    def set_attempt(self, token: str) -> None:  # noqa: B027 - staging in place has no name
        """Name the staging area after `token`, the same on every process of one job and
        different between jobs, so that saves of two jobs to one location never share it."""

    @abstractmethod
    def prepare_staging(self) -> None:
        """Create the staging area. Idempotent: every process of a save may call it."""

    @abstractmethod
    def open_writer(self, name: str) -> FileWriter: ...

    def write_bytes(self, name: str, data: bytes) -> int:
        w = self.open_writer(name)
        try:
            w.write(memoryview(data))
            return w.close()
        except BaseException:
            w.abort()
            raise

    @abstractmethod
    def list_staging(self) -> dict[str, int]:
        """Every file in the staging area with its size."""

    @abstractmethod
    def read_staging(self, name: str) -> bytes: ...

    @abstractmethod
    def delete_staging_files(self, names: Sequence[str]) -> None: ...

    @abstractmethod
    def commit(self, manifest: bytes, *, overwrite: bool) -> None:
        """Write the manifest and make the staged checkpoint visible, all or nothing."""

    @abstractmethod
    def discard_staging(self) -> None:
        """Remove the staging area (best effort)."""

    def discard_staging_if_empty(self) -> None:  # noqa: B027 - staging in place has no folder
        """Remove the staging area if nothing is left in it (best effort)."""

    # ---- read side -------------------------------------------------------------------
    @abstractmethod
    def is_committed(self) -> bool: ...

    def is_retained(self) -> bool:
        """Whether this is a step kept only for the files later steps refer to (its
        RETAINED marker: manager/references.py), no checkpoint to read."""
        return False

    def missing_file(
        self, name: str, manifest: bytes | None
    ) -> CheckpointNotFoundError | CorruptCheckpointError:
        """The error of a committed file found missing, told from what is there now (the
        `manifest` there, None: none): deleted while it was read (a writer's retention), a
        step kept only for the files later steps refer to, replaced while it was read (an
        overwrite: the manifest names the save's nonce no more), or else damage."""
        if manifest is None:
            return deleted_while_read(self.url, name)
        if self.is_retained():
            return CheckpointNotFoundError(
                f"{self.url}: this step is kept only for the files later steps refer to (a "
                "CheckpointManager's retention dropped it, an incremental run's later steps "
                "use its data); it is no checkpoint to read: read a kept step"
            )
        nonce = file_nonce(name)
        if nonce is not None and nonce.encode() not in manifest:
            return CheckpointNotFoundError(
                f"{self.url}: the checkpoint was replaced while it was read (file {name!r} is "
                "of the save an overwrite replaced): read it again"
            )
        return CorruptCheckpointError(f"{self.url}: file {name!r} is missing")

    @abstractmethod
    def read_manifest(self) -> bytes:
        """The manifest bytes; raises CheckpointNotFoundError when nothing is committed here."""

    @abstractmethod
    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Read len(sum(buffers)) bytes of a committed file from `offset`, filling the buffers in order."""

    @abstractmethod
    def delete(self) -> None:
        """Remove a committed checkpoint so that it is never seen half-deleted."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release cached handles."""

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CheckpointRoot(ABC):
    """A location holding several checkpoints side by side (the steps of a manager)."""

    url: str

    @abstractmethod
    def list(self) -> dict[str, bool]:
        """Every checkpoint name under the root, with whether it is committed.

        Incomplete saves (staging areas, checkpoints being deleted, object-store prefixes
        without their commit marker) are listed as False under the checkpoint's name. The
        writer lease (`.snapshard-writer`) is not a checkpoint and is never listed.
        """

    @abstractmethod
    def child(self, name: str) -> Storage:
        """The storage of the checkpoint `name` under this root."""

    @abstractmethod
    def lease_files(self) -> LeaseFiles:
        """Where the root's writer lease lives (see lease.py)."""

    @abstractmethod
    def remove_incomplete(self, name: str) -> None:
        """Delete whatever an unfinished save or delete of `name` left (never a committed checkpoint)."""
