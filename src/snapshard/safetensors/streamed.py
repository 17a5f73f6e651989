"""Safetensors written by one process from tensors produced slab by slab, never more than
one slab in memory (`snapshard convert --to safetensors`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..storage import Location
from ..storage.stale_staging import STAGING_SUFFIX
from . import writing
from .dtypes import safetensors_name
from .header import build_header


@dataclass(frozen=True)
class StreamedTensor:
    """A tensor written slab by slab: `slabs()` yields (byte offset in the tensor, C-order
    bytes), so that no more than one slab is in memory."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    slabs: Callable[[], Iterable[tuple[int, np.ndarray]]]


def save_streamed(
    path: Location,
    tensors: list[StreamedTensor],
    *,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    max_file_bytes: int | None = None,
) -> writing.ExportResult:
    """One process writes safetensors from tensors produced slab by slab (what `snapshard
    convert` uses): each file's header first, each slab at its offset, then the result
    appears atomically. Without `max_file_bytes`, `path` is one file; with it, `path` is a
    directory of numbered files of at most that many tensor bytes (a tensor larger than
    that gets a file of its own) and `model.safetensors.index.json` (or `model.safetensors`
    alone when everything fits in one)."""
    final = writing.destination(path, overwrite)
    ordered = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.name))  # as the library orders
    staging = final.with_name(final.name + STAGING_SUFFIX)
    final.parent.mkdir(parents=True, exist_ok=True)
    writing.discard(staging)
    written = 0
    try:
        if max_file_bytes is None:
            written = _write_streamed(staging, ordered, metadata, progress)
            names = [final.name]
        else:
            groups = writing.grouped(ordered, lambda t: math.prod(t.shape) * t.dtype.itemsize,
                                     max_file_bytes)  # fmt: skip
            names = writing.file_names(len(groups))
            staging.mkdir()
            for name, group in zip(names, groups, strict=True):
                written += _write_streamed(staging / name, group, metadata, progress)
            if len(groups) > 1:
                weight_map = {t.name: n for n, g in zip(names, groups, strict=True) for t in g}
                writing.write_index(staging, weight_map, written)
    except BaseException:
        writing.discard(staging)
        raise
    writing.commit(staging, final, overwrite)
    return writing.ExportResult(names, written, {t.name: t.name for t in ordered})


def _write_streamed(
    path: Path,
    ordered: list[StreamedTensor],
    metadata: dict[str, str] | None,
    progress: Callable[[int], None] | None,
) -> int:
    """One safetensors file at `path` (created, fsynced); returns the tensor bytes."""
    entries = [(t.name, safetensors_name(t.dtype, f"tensor {t.name!r}"), t.shape) for t in ordered]
    header, spans = build_header(entries, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    written = 0
    try:
        writing.pwrite_all(fd, memoryview(header), 0)
        for t in ordered:
            begin = spans[t.name][0]
            for offset, data in t.slabs():
                raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
                writing.pwrite_all(fd, raw.data, begin + offset)
                written += raw.nbytes
                if progress is not None:
                    progress(raw.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written
