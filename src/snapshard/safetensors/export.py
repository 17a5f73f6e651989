"""Export sharded arrays as safetensors files, every process writing only its own bytes.

Every process computes the same header and tensor offsets from metadata it already has, and
the write planner (planning.plan_writes) chooses who writes each shard, so a replicated shard
is written once and no array is gathered to one host. Each process writes the byte runs of
its boxes at their offsets in a shared staging file (or directory, for several files); after
all have reported, process 0 renames it into place, so the result appears whole or not at
all and an existing file is never damaged. Needs a filesystem all processes see.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..coordination import Coordinator, default_coordinator
from ..coordination.rendezvous import Rendezvous, namespace, write_then_commit
from ..errors import CheckpointExistsError, StorageError, UnsupportedLeafError
from ..format.kinds import LeafKind
from ..options import SaveOptions, require
from ..planning import plan_writes, run_grid
from ..save_leaves import SaveArray, classify, is_save_leaf
from ..staging import stage
from ..storage import Location, is_object_store_url
from ..storage.atomic_rename import fsync_dir, move_into_place
from ..storage.stale_staging import STAGING_SUFFIX
from ..tree import flatten, path_str
from .dtypes import safetensors_name
from .files import INDEX_NAME, SINGLE_NAME, SUFFIX
from .header import build_header

T = TypeVar("T")


@dataclass
class ExportResult:
    """What an export wrote, as seen by this process."""

    files: list[str]  # names of the data files written, relative to their directory
    bytes_written: int  # tensor bytes this process wrote
    names: dict[str, str] = field(default_factory=dict)  # tensor name -> leaf it came from
    skipped: list[str] = field(default_factory=list)  # leaves left out (prng_keys="skip")


PRNG_KEY_POLICIES = ("data", "skip", "refuse")


@dataclass(frozen=True)
class ExportNames:
    r"""Which leaves an export writes, and under which names; the same rules for
    `snapshard.safetensors.save` and `snapshard convert --to safetensors`.

    Names start as the leaf's path joined with '.' (`model.blocks.0.qkv.kernel.value`).

    - `select`: patterns; a leaf is written if any matches its name, as a glob (`*` also
      matches dots) or as a prefix of whole components (`model` selects `model.…`).
      Empty: every leaf.
    - `rename`: (regex, replacement) pairs applied in order with `re.sub` to the selected
      names: `(r"^model\.", "")`, `(r"\.value$", "")`.
    - `transpose`: globs on the renamed names; those tensors are written with their axes
      reversed (a `(in, out)` kernel as a `(out, in)` weight).
    - `prng_keys`: typed PRNG keys are written as their uint32 key data ("data"), left out
      ("skip"), or an error ("refuse").
    """

    select: tuple[str, ...] = ()
    rename: tuple[tuple[str, str], ...] = ()
    transpose: tuple[str, ...] = ()
    prng_keys: str = "data"

    def __post_init__(self) -> None:
        if self.prng_keys not in PRNG_KEY_POLICIES:
            raise ValueError(
                f"prng_keys must be one of {PRNG_KEY_POLICIES}, not {self.prng_keys!r}"
            )
        for pattern, _ in self.rename:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"rename pattern {pattern!r} is not a regular expression: {e}"
                ) from None

    def selects(self, name: str) -> bool:
        if not self.select:
            return True
        return any(
            name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p)
            for p in self.select
        )

    def renamed(self, name: str) -> str:
        for pattern, replacement in self.rename:
            name = re.sub(pattern, replacement, name)
        return name

    def transposes(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.transpose)

    def check_key(self, leaf: str) -> bool:
        """Whether a PRNG key leaf is written (False: skipped); raises under "refuse"."""
        if self.prng_keys == "refuse":
            raise UnsupportedLeafError(
                f"leaf {leaf!r} is a PRNG key; safetensors holds arrays only (pass "
                "prng_keys='data' to write its key data, or 'skip' to leave it out)"
            )
        return self.prng_keys == "data"

    def plan(self, names: list[str]) -> list[tuple[str, str, bool]]:
        """(leaf name, tensor name, transposed) for the selected names, in order; two leaves
        renamed alike are an error naming both."""
        out = []
        seen: dict[str, str] = {}
        for name in names:
            new = self.renamed(name)
            if not new:
                raise ValueError(f"leaf {name!r} is renamed to an empty name")
            if new in seen:
                raise ValueError(
                    f"leaves {seen[new]!r} and {name!r} would both be named {new!r} in safetensors"
                )
            seen[new] = name
            out.append((name, new, self.transposes(new)))
        return out


def export_names(
    select: str | list[str] | tuple[str, ...] | None = None,
    rename: dict[str, str] | list[tuple[str, str]] | tuple[tuple[str, str], ...] | None = None,
    transpose: str | list[str] | tuple[str, ...] | None = None,
    prng_keys: str = "data",
) -> ExportNames:
    """An ExportNames from the friendlier forms the public functions accept."""

    def strings(x: Any) -> tuple[str, ...]:
        if x is None:
            return ()
        return (x,) if isinstance(x, str) else tuple(x)

    pairs = tuple(rename.items()) if isinstance(rename, dict) else tuple(rename or ())
    return ExportNames(
        strings(select), tuple((str(a), str(b)) for a, b in pairs), strings(transpose), prng_keys
    )


def leaf_name(path: tuple[Any, ...]) -> str:
    """A leaf's default tensor name: its path joined with '.' ('root' for the root)."""
    return ".".join(str(k) for k in path) or "root"


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
    groups = _grouped(tensors, lambda t: t.array.layout.nbytes, most)
    names = [single] if single is not None else _file_names(len(groups))
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
                _pwrite_all(fds[f.name], data.data[d : d + run], base + s)
            written += data.nbytes
            item.release()
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return written


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


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
            _pwrite_all(fd, memoryview(f.header), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    if directory and len(files) > 1:
        weight_map = {t.name: f.name for f in files for t in f.tensors}
        _write_index(staging, weight_map, sum(f.size - len(f.header) for f in files))


def _commit(staging: Path, final: Path, overwrite: bool) -> None:
    """Process 0: move the staged result into place; an existing one is replaced whole."""
    if staging.is_dir():
        for p in staging.iterdir():
            if p.is_file() and p.suffix == ".json":
                with open(p, "rb") as fh:
                    os.fsync(fh.fileno())
        fsync_dir(staging)
    move_into_place(staging, final, replace=overwrite)


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
) -> ExportResult:
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
    final = _final_path(path)
    directory = not final.name.endswith(SUFFIX)
    if final.exists() and not overwrite:
        raise CheckpointExistsError(f"{final} already exists (pass overwrite=True to replace it)")
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
        lambda _reports: _commit(staging, final, overwrite),
        lambda: _discard(staging),
    )
    origin = {t.name: path_str(t.array.path) for f in files for t in f.tensors}
    return ExportResult([f.name for f in files], int(mine["bytes"]), origin, skipped)


def _export_options(options: SaveOptions) -> SaveOptions:
    """The export's SaveOptions, checked for what applies to safetensors."""
    require(options, SaveOptions)
    if options.writers is not None or options.compression is not None or options.hashes:
        raise ValueError(
            "safetensors export takes mode, host_budget and timeout_s from SaveOptions; "
            "writers, compression and hashes are snapshard's format's and do not apply"
        )
    return options


def _final_path(path: Location) -> Path:
    """Where the export goes: a local path (every process writes byte ranges into it)."""
    text = os.fspath(path)
    if is_object_store_url(text):
        raise StorageError(
            f"cannot export to {text}: every process writes byte ranges into shared files, "
            "which needs a filesystem (export locally, then upload)"
        )
    return Path(os.path.abspath(text.removeprefix("file://")))


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


def _discard(staging: Path) -> None:
    if staging.is_dir():
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.unlink(missing_ok=True)


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
) -> ExportResult:
    """One process writes safetensors from tensors produced slab by slab (what `snapshard
    convert` uses): each file's header first, each slab at its offset, then the result
    appears atomically. Without `max_file_bytes`, `path` is one file; with it, `path` is a
    directory of numbered files of at most that many tensor bytes (a tensor larger than
    that gets a file of its own) and `model.safetensors.index.json` (or `model.safetensors`
    alone when everything fits in one)."""
    text = os.fspath(path)
    if is_object_store_url(text):
        raise StorageError(f"cannot write {text}: safetensors export needs a filesystem")
    final = Path(os.path.abspath(text.removeprefix("file://")))
    if final.exists() and not overwrite:
        raise CheckpointExistsError(f"{final} already exists (pass overwrite=True to replace it)")
    ordered = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.name))  # as the library orders
    staging = final.with_name(final.name + STAGING_SUFFIX)
    final.parent.mkdir(parents=True, exist_ok=True)
    _discard(staging)
    written = 0
    try:
        if max_file_bytes is None:
            written = _write_streamed(staging, ordered, metadata, progress)
            names = [final.name]
        else:
            groups = _grouped(ordered, lambda t: math.prod(t.shape) * t.dtype.itemsize,
                              max_file_bytes)  # fmt: skip
            names = _file_names(len(groups))
            staging.mkdir()
            for name, group in zip(names, groups, strict=True):
                written += _write_streamed(staging / name, group, metadata, progress)
            if len(groups) > 1:
                weight_map = {t.name: n for n, g in zip(names, groups, strict=True) for t in g}
                _write_index(staging, weight_map, written)
    except BaseException:
        _discard(staging)
        raise
    _commit(staging, final, overwrite)
    return ExportResult(names, written, {t.name: t.name for t in ordered})


def _grouped(items: list[T], nbytes: Callable[[T], int], most: int | None) -> list[list[T]]:
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


def _file_names(count: int) -> list[str]:
    """The files of an export into a directory, as Hugging Face names them."""
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}{SUFFIX}" for i in range(count)]


def _write_index(directory: Path, weight_map: dict[str, str], total: int) -> None:
    doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_NAME).write_text(json.dumps(doc, indent=2))


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
        _pwrite_all(fd, memoryview(header), 0)
        for t in ordered:
            begin = spans[t.name][0]
            for offset, data in t.slabs():
                raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
                _pwrite_all(fd, raw.data, begin + offset)
                written += raw.nbytes
                if progress is not None:
                    progress(raw.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written
