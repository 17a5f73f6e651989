"""Every exception class snapshard defines crosses a process boundary intact: pickled and
unpickled (what DCP's all_gather_object, multiprocessing and the launchers do), it keeps its
type, its message and its fields.

The classes are found by importing every module of the package, so that a class added later
is covered; one whose constructor takes something else than a message needs a sample in
`SAMPLES` (the test says so)."""

from __future__ import annotations

import concurrent.futures
import errno
import importlib
import inspect
import multiprocessing
import pickle
import pkgutil
import sys
import threading
from typing import Any

import pytest

import snapshard
from snapshard.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    SnapshardError,
    StorageError,
    WriterLeaseError,
)

# Positional and keyword arguments of the classes whose constructor is not the message's.
SAMPLES: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "snapshard.errors.ChecksumMismatchError": (
        (),
        dict(file="d0.bin", leaf="model/w", chunk=3, block=1, expected=0xDEADBEEF, actual=7),
    ),
    "snapshard.errors.WriterLeaseError": (
        ("root 'runs/a' is held by another writer",),
        dict(holder={"host": "node-1", "pid": 42, "token": "ab12"}),
    ),
    "snapshard.manager.writer.BackgroundSaveError": ((7, OSError(28, "no space left")), {}),
}
OS_FIELDS = ("errno", "strerror", "filename", "filename2")


def _exception_classes() -> list[type[BaseException]]:
    """Every exception (and warning) class defined at module level in the package."""
    for info in pkgutil.walk_packages(snapshard.__path__, "snapshard."):
        if info.name.rpartition(".")[2] == "__main__":
            continue  # running it is the CLI
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if (e.name or "").startswith("snapshard"):
                raise
            # an extra this environment lacks: its modules are checked where it is installed
    found: dict[str, type[BaseException]] = {}
    for name in list(sys.modules):
        if name != "snapshard" and not name.startswith("snapshard."):
            continue
        for value in vars(sys.modules[name]).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.partition(".")[0] == "snapshard"
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return [found[k] for k in sorted(found)]


CLASSES = _exception_classes()


def _own_init(cls: type[BaseException]) -> bool:
    """Whether the class or a snapshard base defines its own constructor."""
    return any("__init__" in vars(c) for c in cls.__mro__ if c.__module__.startswith("snapshard"))


def _sample(cls: type[BaseException]) -> BaseException:
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name in SAMPLES:
        args, kwargs = SAMPLES[name]
        return cls(*args, **kwargs)
    assert not _own_init(cls), (
        f"{name} has a constructor of its own: add a sample of its arguments to SAMPLES"
    )
    return cls(f"{cls.__name__}: checkpoint 'runs/a/step_5', leaf 'model/w': sample problem")


def _state(error: BaseException) -> dict[str, Any]:
    """What must survive the trip: type, message, args and fields."""
    out = {"type": type(error), "str": str(error), "args": error.args, **vars(error)}
    if isinstance(error, OSError):
        out.update((f, getattr(error, f)) for f in OS_FIELDS)
    return out


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, BaseException):  # compared by what they say
            assert type(got[key]) is type(value) and str(got[key]) == str(value), key
        elif key == "args":
            assert [str(a) for a in got[key]] == [str(a) for a in value]
        else:
            assert got[key] == value, key


def test_the_package_defines_the_classes_the_stacks_meet():
    names = {c.__name__ for c in CLASSES}
    for known in ("SnapshardError", "ChecksumMismatchError", "StorageError", "WriterLeaseError"):
        assert known in names
    assert any(
        issubclass(c, SnapshardError) and c.__module__ != "snapshard.errors" for c in CLASSES
    )


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_class_round_trips_through_pickle(cls):
    error = _sample(cls)
    want = _state(error)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(error, protocol=protocol))
        _same(_state(back), want)


def test_the_fields_of_a_checksum_mismatch_survive():
    error = ChecksumMismatchError(
        file="d1.bin", leaf="opt/mu", chunk=2, block=5, expected=0x1234, actual=0x5678
    )
    back = pickle.loads(pickle.dumps(error))
    assert isinstance(back, ChecksumMismatchError) and isinstance(back, CorruptCheckpointError)
    assert (back.file, back.leaf, back.chunk, back.block) == ("d1.bin", "opt/mu", 2, 5)
    assert (back.expected, back.actual) == (0x1234, 0x5678)
    assert "'d1.bin'" in str(back) and "'opt/mu'" in str(back)


def test_a_storage_error_keeps_its_errno_and_message():
    error = StorageError.wrap(OSError(errno.ENOSPC, "No space left"), "write", "runs/a/d0.bin")
    back = pickle.loads(pickle.dumps(error))
    assert back.errno == errno.ENOSPC
    assert str(back) == str(error) == "write runs/a/d0.bin failed: No space left [ENOSPC]"
    # OSError's own form (errno, strerror, filename) too
    error = StorageError(errno.EIO, "I/O error", "runs/a/d1.bin")
    back = pickle.loads(pickle.dumps(error))
    assert (back.errno, back.strerror, back.filename) == (errno.EIO, "I/O error", "runs/a/d1.bin")
    assert str(back) == str(error)


def test_a_field_that_cannot_be_pickled_travels_as_its_repr():
    holder = {"host": "node-1", "lock": threading.Lock()}  # locks do not pickle
    error = WriterLeaseError("root 'runs/a' is held", holder)
    error.add_note("seen at step 9")
    back = pickle.loads(pickle.dumps(error))
    assert str(back) == "root 'runs/a' is held"
    assert back.holder == repr(holder)
    assert back.__notes__ == ["seen at step 9"]


def test_an_error_raised_in_a_child_process_reaches_the_parent():
    error = ChecksumMismatchError(
        file="d0.bin", leaf="model/w", chunk=0, block=0, expected=1, actual=2
    )
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        # The error goes to the child pickled and comes back pickled; a builtin runs it, so
        # the child imports no test module (and does not walk the package again).
        future = pool.submit(exec, "raise error", {"error": error})
        with pytest.raises(ChecksumMismatchError) as caught:
            future.result(timeout=120)
    assert caught.value.file == "d0.bin" and caught.value.leaf == "model/w"
    assert str(caught.value) == str(error)
