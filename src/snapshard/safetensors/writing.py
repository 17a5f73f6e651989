"""What both safetensors exports share (`export.py`: every process writes its own byte runs;
`streamed.py`: one process writes slab by slab): where the result goes, how the tensors are
cut into Hugging Face's numbered files and their index, positioned writes, and the staging
file or directory beside the result that is renamed into place whole or removed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from ..errors import CheckpointExistsError, StorageError
from ..storage import Location, is_object_store_url
from ..storage.atomic_rename import fsync_dir, move_into_place
from .files import INDEX_NAME, SINGLE_NAME, SUFFIX

T = TypeVar("T")


@dataclass
class ExportResult:
    """What an export wrote, as seen by this process."""

    files: list[str]  # names of the data files written, relative to their directory
    bytes_written: int  # tensor bytes this process wrote
    names: dict[str, str] = field(default_factory=dict)  # tensor name -> leaf it came from
    skipped: list[str] = field(default_factory=list)  # leaves left out (prng_keys="skip")


def destination(path: Location, overwrite: bool) -> Path:
    """Where an export goes: a local path (files are written at byte offsets), refused where
    one exists unless `overwrite`."""
    text = os.fspath(path)
    if is_object_store_url(text):
        raise StorageError(
            f"cannot export to {text}: safetensors files are written by byte ranges, "
            "which needs a filesystem (export locally, then upload)"
        )
    final = Path(os.path.abspath(text.removeprefix("file://")))
    if final.exists() and not overwrite:
        raise CheckpointExistsError(f"{final} already exists (pass overwrite=True to replace it)")
    return final


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def grouped(items: list[T], nbytes: Callable[[T], int], most: int | None) -> list[list[T]]:
    """The items in order, cut into files of at most `most` bytes (None: one file); an item
    larger than that has a file of its own."""
    groups: list[list[T]] = [[]]
    size = 0
    for t in items:
        n = nbytes(t)
        if most is not None and groups[-1] and size + n > most:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    return groups


def file_names(count: int) -> list[str]:
    """The files of an export into a directory, as Hugging Face names them."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}{SUFFIX}" for i in range(count)]


def write_index(directory: Path, weight_map: dict[str, str], total: int) -> None:
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(doc, indent=2))


def commit(staging: Path, final: Path, overwrite: bool) -> None:
    """Move the staged result into place; an existing one is replaced whole."""
    if staging.is_dir():
        for p in staging.iterdir():
            if p.is_file() and p.suffix == ".json":
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(staging)
    move_into_place(staging, final, replace=overwrite)


def discard(staging: Path) -> None:
    if staging.is_dir():
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.unlink(missing_ok=True)
