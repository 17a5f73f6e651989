"""Export sharded arrays as safetensors files, every process writing only its own bytes.

Every process computes the same header and tensor offsets from metadata it already has, and
the write planner (planning.plan_writes) chooses who writes each shard, so a replicated shard
is written once and no array is gathered to one host. Each process writes the byte runs of
its boxes at their offsets in a shared staging file (or directory, for several files); after
all have reported, process 0 renames it into place, so the result appears whole or not at
all and an existing file is never damaged. Needs a filesystem all processes see.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..coordination import Coordinator, default_coordinator
from ..coordination.rendezvous import Rendezvous, namespace, write_then_commit
from ..errors import UnsupportedLeafError
from ..format.kinds import LeafKind
from ..options import SaveOptions, require
from ..planning import plan_writes, run_grid
from ..saving.save_array import SaveArray, classify, is_save_leaf
from ..saving.staging import stage
from ..storage import Location
from ..storage.stale_staging import STAGING_SUFFIX
from ..tree import flatten, path_str
from . import writing
from .dtypes import safetensors_name
from .files import SUFFIX
from .header import build_header
from .names import ExportNames, export_names, leaf_name


@dataclass
class _Tensor:
    name: str
    array: SaveArray
    dtype: str  # safetensors name
    transpose: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.array.shape
        return tuple(reversed(shape)) if self.transpose else shape


@dataclass
class _File:
    name: str
    tensors: list[_Tensor]
    header: bytes
    spans: dict[str, tuple[int, int]]

    @property
    def size(self) -> int:
        return len(self.header) + sum(e - b for b, e in self.spans.values())


def _tensors(tree: Any, process_count: int, names: ExportNames) -> tuple[list[_Tensor], list[str]]:
    """The tensors to write (in the file order) and the leaves skipped."""
    flat = flatten(tree, is_save_leaf)
    names.check_selected([leaf_name(path) for path in flat.paths])
    chosen: list[tuple[str, SaveArray]] = []
    skipped: list[str] = []
    for path, value in zip(flat.paths, flat.leaves, strict=True):
        name = leaf_name(path)
        if not names.selects(name):
            continue
        leaf = classify(path, value, process_count)
        if not isinstance(leaf, SaveArray):
            raise UnsupportedLeafError(
                f"leaf {path_str(path)!r}: safetensors files hold arrays only, not "
                f"{type(value).__name__} (leave it out with select=...)"
            )
        if leaf.kind == LeafKind.PRNG_KEY and not names.check_key(path_str(path)):
            skipped.append(path_str(path))
            continue
        chosen.append((name, leaf))
    out = []
    for (name, leaf), (_, new, transposed) in zip(
        chosen, names.plan([n for n, _ in chosen]), strict=True
    ):
        out.append(_Tensor(new, leaf, safetensors_name(leaf.dtype, f"leaf {name!r}"), transposed))
    # The safetensors library's order: larger elements first, then by name (keeps alignment).
    return sorted(out, key=lambda t: (-t.array.dtype.itemsize, t.name)), skipped


def _layout_files(
    tensors: list[_Tensor], single: str | None, max_file_bytes: int | None, metadata: Any
) -> list[_File]:
    most = None if single is not None else (max_file_bytes or None)
    groups = writing.grouped(tensors, lambda t: t.array.layout.nbytes, most)
    names = [single] if single is not None else writing.file_names(len(groups))
    files = []
    for name, group in zip(names, groups, strict=True):
        header, spans = build_header([(t.name, t.dtype, t.shape) for t in group], metadata)
        files.append(_File(name, group, header, spans))
    return files


def _write_own(target: Path, files: list[_File], pid: int, plan: Any, budget: int | None) -> int:
    """pwrite every box this process owns at its tensor's offset; returns the bytes written.

    `target` is the staging file (one file) or the staging directory (several). Boxes are
    staged as a save stages them: zero-copy on CPU, and at most `budget` bytes copied from
    accelerators up front, the rest one box at a time as it is written."""
    tensors = [(f, t) for f in files for t in f.tensors]  # the order of plan.arrays
    items, _ = stage([(a, t.array) for a, (_, t) in enumerate(tensors)], plan, pid, budget=budget)
    fds: dict[str, int] = {}
    written = 0
    try:
        for item in items:
            f, t = tensors[item.leaf]
            box = item.materialize()
            start, stop = item.start, item.stop
            if t.transpose:  # the box of the transposed tensor: axes, and box, reversed
                box, start, stop = box.transpose(), start[::-1], stop[::-1]
            data = np.ascontiguousarray(box).reshape(-1).view(np.uint8)
            if f.name not in fds:
                path = target / f.name if target.is_dir() else target
                fds[f.name] = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            shape = np.asarray(t.shape, dtype=np.int64)
            g = run_grid(
                np.zeros_like(shape), shape, start, stop, start, stop, t.array.dtype.itemsize
            )
            (src, dst), run = g.runs(), g.run_bytes
            base = f.spans[t.name][0]
            for s, d in zip(src.tolist(), dst.tolist(), strict=True):
                writing.pwrite_all(fds[f.name], data.data[d : d + run], base + s)
            written += data.nbytes
            item.release()
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


def _create(staging: Path, files: list[_File], directory: bool) -> None:
    """Process 0: the staging file(s) at full size with their headers, and the index."""
    if directory:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    else:
        staging.unlink(missing_ok=True)
    for f in files:
        path = staging / f.name if directory else staging
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.ftruncate(fd, f.size)
            writing.pwrite_all(fd, memoryview(f.header), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    if directory and len(files) > 1:
        weight_map = {t.name: f.name for f in files for t in f.tensors}
        writing.write_index(staging, weight_map, sum(f.size - len(f.header) for f in files))


def save(
    path: Location,
    tree: Any,
    options: SaveOptions = SaveOptions(),
    *,
    max_file_bytes: int | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    coordinator: Coordinator | None = None,
    select: str | list[str] | tuple[str, ...] | None = None,
    rename: dict[str, str] | list[tuple[str, str]] | None = None,
    transpose: str | list[str] | tuple[str, ...] | None = None,
    prng_keys: str = "data",
) -> writing.ExportResult:
    """Write `tree` (jax.Arrays with any sharding, or NumPy arrays) as safetensors.

    Tensor names are the leaves' paths joined with '.'; `select`, `rename`, `transpose`
    and `prng_keys` choose the leaves, rename them and reverse the axes of some, with the
    rules of `ExportNames` (the same as `snapshard convert --to safetensors`). A path
    ending in `.safetensors` is one file; any other path is a directory holding
    `model.safetensors`, or, when the tensors exceed `max_file_bytes`, numbered files and
    `model.safetensors.index.json`.
    Every process of a multi-process job calls this with the same tree. `metadata` is the
    header's `__metadata__` (Hugging Face transformers wants {"format": "pt"}).
    `options`: a SaveOptions, of which `mode`, `host_budget` and `timeout_s` apply (as in
    snapshard.save); writers, compression and hashes are snapshard's format's and refused
    here.
    """
    options = _export_options(options)
    final = writing.destination(path, overwrite)
    directory = not final.name.endswith(SUFFIX)
    coord = coordinator or default_coordinator()
    names = export_names(select, rename, transpose, prng_keys)
    tensors, skipped = _tensors(tree, coord.process_count, names)
    files = _layout_files(tensors, None if directory else final.name, max_file_bytes, metadata)
    plan = plan_writes(
        [t.array.layout for f in files for t in f.tensors], options.mode,
        num_processes=coord.process_count,
    )  # fmt: skip
    staging = final.with_name(final.name + STAGING_SUFFIX)
    rv = Rendezvous(
        coord, namespace("safetensors-export", str(final)), f"export to {final}", options.timeout_s
    )
    rv.start_clock()
    _create_staging(rv, staging, final, files, directory)
    # Everyone writes its own byte runs and reports; process 0 commits once all have.
    pid, budget = coord.process_index, options.host_budget
    mine = write_then_commit(
        rv,
        lambda: {"bytes": _write_own(staging, files, pid, plan, budget)},
        lambda _reports: writing.commit(staging, final, overwrite),
        lambda: writing.discard(staging),
    )
    origin = {t.name: path_str(t.array.path) for f in files for t in f.tensors}
    return writing.ExportResult([f.name for f in files], int(mine["bytes"]), origin, skipped)


def _export_options(options: SaveOptions) -> SaveOptions:
    """The export's SaveOptions, checked for what applies to safetensors."""
    require(options, SaveOptions)
    if options.writers is not None or options.compression is not None or options.hashes:
        raise ValueError(
            "safetensors export takes mode, host_budget and timeout_s from SaveOptions; "
            "writers, compression and hashes are snapshard's format's and do not apply"
        )
    return options


def _create_staging(
    rv: Rendezvous, staging: Path, final: Path, files: list[_File], directory: bool
) -> None:
    """Process 0 creates the staging file(s) at full size; the others wait for them."""
    if not rv.coord.is_leader:
        rv.wait("ready", "process 0")
        return
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        _create(staging, files, directory)
    except BaseException as e:
        rv.report("ready", e)
        raise
    rv.report("ready")
