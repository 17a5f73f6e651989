"""The exceptions snapshard raises. Every message names the path, the leaf and the problem."""

from __future__ import annotations

import errno
import pickle
from typing import Any

# OSError keeps these in slots of its own, not in the instance's __dict__.
_OS_FIELDS = ("errno", "strerror", "filename", "filename2")


class SnapshardError(Exception):
    """Base class of every error raised by snapshard.

    Every instance pickles with its type, its message (`args`) and its fields (the instance's
    attributes, and OSError's errno, strerror and filenames): the stacks move errors between
    processes with pickle (DCP gathers each rank's exception with all_gather_object;
    multiprocessing; launchers). Python's default calls the class again with `args`, which
    fails for constructors that take something else than the message (keyword-only fields,
    a cause); here the instance is rebuilt without calling `__init__` (`rebuild_error`)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (rebuild_error, (type(self), self.args, error_fields(self)))


def error_fields(error: BaseException) -> dict[str, Any]:
    """The attributes of `error` to restore after unpickling. A value that cannot be
    pickled travels as its repr: the error must arrive, even with a field described."""
    fields = dict(vars(error))
    if isinstance(error, OSError):
        # An unset slot reads as None, but a None set back counts as set for str().
        os_fields = ((name, getattr(error, name)) for name in _OS_FIELDS)
        fields.update((name, value) for name, value in os_fields if value is not None)
    for name, value in fields.items():
        try:
            pickle.dumps(value)
        except Exception:
            fields[name] = repr(value)
    return fields


def rebuild_error(cls: type[SnapshardError], args: tuple[Any, ...], fields: dict[str, Any]) -> Any:
    """A pickled SnapshardError again: made by its `__new__` (OSError's parses `args` as
    when it was raised), its `args` and fields set back, its `__init__` not called."""
    error = cls.__new__(cls, *args)
    error.args = args
    for name, value in fields.items():
        setattr(error, name, value)
    return error


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
