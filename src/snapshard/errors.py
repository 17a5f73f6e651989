"""The exceptions snapshard raises. Every message names the path, the leaf and the problem."""

from __future__ import annotations

import errno


class SnapshardError(Exception):
    """Base class of every error raised by snapshard."""


class CheckpointNotFoundError(SnapshardError, FileNotFoundError):
    """No committed checkpoint at the given location."""


class CheckpointExistsError(SnapshardError, FileExistsError):
    """A committed checkpoint is already at the location and overwrite was not asked for."""


class CorruptCheckpointError(SnapshardError):
    """The manifest or an index is unreadable, malformed, or inconsistent with the data."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Bytes read back do not match the checksum recorded at save time."""

    def __init__(self, *, file: str, leaf: str, chunk: int, block: int, expected: int, actual: int):
        self.file, self.leaf, self.chunk, self.block = file, leaf, chunk, block
        self.expected, self.actual = expected, actual
        super().__init__(
            f"checksum mismatch in file {file!r}, leaf {leaf!r}, chunk {chunk}, block {block}: "
            f"expected crc32c {expected:#010x}, read {actual:#010x}"
        )


class ValidationError(CorruptCheckpointError):
    """A merged manifest does not cover every array exactly once, or is otherwise invalid."""


class TargetMismatchError(SnapshardError, ValueError):
    """The restore target does not fit the saved tree (structure, shape or kind)."""


class UnsupportedLeafError(SnapshardError, TypeError):
    """A leaf of the tree has a type snapshard cannot save."""


class DeletedArrayError(SnapshardError, RuntimeError):
    """A jax.Array leaf was deleted (or donated) before snapshard could read it."""


class CoordinationError(SnapshardError):
    """Another process failed, or did not report within the timeout."""


class StorageError(SnapshardError, OSError):
    """The storage backend failed in a way that retrying will not fix.

    The message names the operation and the path; `errno` is the system's error number
    when the failure came from the operating system."""

    @classmethod
    def wrap(cls, error: OSError, operation: str, path: object) -> StorageError:
        """`error` of `operation` on `path` as a StorageError (a SnapshardError is kept)."""
        if isinstance(error, SnapshardError):
            return error  # type: ignore[return-value]
        why = error.strerror or str(error)
        code = errno.errorcode.get(error.errno or -1)
        out = cls(f"{operation} {path} failed: {why}" + (f" [{code}]" if code else ""))
        out.errno = error.errno
        return out


class WriterLeaseError(SnapshardError):
    """Another writer holds the root's writer lease (or took it over from this one)."""

    def __init__(self, message: str, holder: dict[str, object] | None = None):
        self.holder = holder or {}
        super().__init__(message)
