"""What every wing's restore shares: which target values are leaves, a target checked
against the checkpoint (missing leaves, empty containers), each process's own per-process
values, and an array leaf built from host data as a restore builds it (the local tier)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from .. import per_process
from ..checksum import crc32c
from ..coordination import Coordinator, default_coordinator
from ..dtypes import dtype_from_name
from ..errors import CorruptCheckpointError, TargetMismatchError
from ..format import Manifest
from ..format.leaves import ArrayLeaf, PerProcessLeaf
from ..format.naming import values_file_name
from ..frameworks import is_jax_array, is_shape_dtype_struct
from ..iterators import is_data_iterator
from ..per_process import PerProcess, Resplit
from ..storage import Storage
from ..tree import Path, empty_containers, path_str
from . import make_request


def is_target_leaf(x: Any) -> bool:
    return (
        isinstance(x, np.ndarray | np.generic | bool | int | float | str | bytes | PerProcess)
        or is_jax_array(x)
        or is_shape_dtype_struct(x)
        or is_data_iterator(x)
    )


def _read_values_file(storage: Storage, manifest: Manifest, q: int) -> dict[int, Any]:
    table = manifest.processes
    assert table is not None and table.values_sizes
    if not table.values_sizes[q]:  # saved none (trees that differ by process): no file
        return {}
    name = values_file_name(q, table.nonces[q])
    buf = bytearray(table.values_sizes[q])
    storage.read_into(name, 0, [memoryview(buf)])
    if crc32c(bytes(buf)) != table.values_crcs[q]:
        raise CorruptCheckpointError(
            f"{storage.url}/{name}: per-process values fail their checksum"
        )
    return per_process.decode_file(bytes(buf), f"{storage.url}/{name}")


def values_saved_elsewhere(manifest: Manifest, process: int, processes: int) -> set[int]:
    """Indices of the per-process leaves `process` saved no value of (its tree had no such
    leaf: trees that differ by process), which a load without a target leaves out of what
    it gives that process; none where the job's process count is not the saved one (all
    values are then re-split)."""
    index = [i for i, leaf in enumerate(manifest.leaves) if isinstance(leaf, PerProcessLeaf)]
    if not index or processes != manifest.process_count:
        return set()
    own = manifest.local_leaves(process, np.asarray(index))
    return {i for i, k in zip(index, own.tolist(), strict=True) if k < 0}


def per_process_values(
    storage: Storage,
    manifest: Manifest,
    leaves: list[PerProcessLeaf],
    resplit: Resplit | None,
    coordinator: Coordinator | None = None,
) -> dict[Path, Any]:
    """This process's own values of `leaves`; on another process count, `resplit` of all
    processes' values, else an error naming the leaf. `coordinator` says which process this
    is (default: JAX's, or a single process)."""
    if not leaves:
        return {}
    coord = coordinator or default_coordinator()
    me, n = coord.process_index, coord.process_count
    index = {id(leaf): i for i, leaf in enumerate(manifest.leaves)}
    url = storage.url
    if n != manifest.process_count and resplit is None:
        raise TargetMismatchError(
            f"{url}: leaf {leaves[0].name!r} holds one value per process, saved by "
            f"{manifest.process_count} processes; this job has {n}. Pass "
            "load(..., resplit=fn) to say how to re-split them"
        )
    wanted = range(manifest.process_count) if n != manifest.process_count else [me]
    files = {q: _read_values_file(storage, manifest, q) for q in wanted}
    out: dict[Path, Any] = {}
    for leaf in leaves:
        i = index[id(leaf)]
        got = []
        for q in wanted:
            own = int(manifest.local_leaves(q, np.asarray([i]))[0])  # (format.leaf_map)
            if own < 0:
                raise TargetMismatchError(
                    f"{url}: leaf {leaf.name!r} holds one value per process, and process {q} "
                    "saved none (its tree had no such leaf): load it where it was saved"
                )
            if own not in files[q]:
                raise CorruptCheckpointError(
                    f"{url}: process {q} has no value for leaf {leaf.name!r}"
                )
            got.append(per_process.decode(files[q][own], f"{url}, leaf {leaf.name!r}"))
        out[leaf.path] = (
            got[0]
            if resplit is None or n == manifest.process_count
            else resplit(leaf.name, got, me, n)
        )
    return out


def build_from_host(
    saved: ArrayLeaf,
    target: Any,
    boxes: Mapping[tuple[tuple[int, ...], tuple[int, ...]], np.ndarray],
    url: str,
) -> Any:
    """`target`'s leaf of the saved array `saved`, built as `load` builds it (the target's
    sharding, shape and dtype checked against `saved`) from host data instead of storage:
    `boxes` maps boxes (start, stop) of the saved array to their values, and covers the
    boxes this process holds for the target."""
    req = make_request(saved, target, url)
    dtype = dtype_from_name(saved.dtype)
    for d in req.dests():
        buf = d.buf.view(dtype).reshape(d.shape)
        for (start, stop), values in boxes.items():
            lo, hi = np.maximum(d.start, start), np.minimum(d.stop, stop)
            if np.all(hi > lo):  # the overlap of the box and the buffer
                into = tuple(map(slice, lo - d.start, hi - d.start))
                src = tuple(map(slice, lo - np.asarray(start), hi - np.asarray(start)))
                buf[into] = np.asarray(values, dtype=dtype)[src]
    req.finish()
    return req.value


def missing_target_leaf(url: str, path: Path, saved: Mapping[Path, Any]) -> TargetMismatchError:
    """The error for a target leaf at `path` that the checkpoint (leaves `saved`) lacks: it
    names the subtree saved there, or the leaves saved beside it."""
    above = next((path[:k] for k in range(len(path) - 1, 0, -1) if path[:k] in saved), None)
    if above is not None:
        leaf = saved[above]
        what = "a snapshard.PerProcess value" if isinstance(leaf, PerProcessLeaf) else "a value"
        if isinstance(leaf, ArrayLeaf):
            what = f"an array, {leaf.dtype}{list(leaf.shape)}"
            if leaf.dtype == "uint8" and len(leaf.shape) == 1:  # (what DCP pickled, maybe)
                what += " (an object DCP pickled is kept as its bytes: load_pickled reads it)"
        return TargetMismatchError(
            f"{url}: the target has a subtree at {path_str(above)!r} (leaf {path_str(path)!r}), "
            f"where the checkpoint has one leaf, {what}: give one leaf there in the target "
            "(snapshard.PerProcess(None) for a per-process value), or leave it out"
        )
    below = [p for p in saved if p[: len(path)] == path]
    if below:
        return TargetMismatchError(
            f"{url}: the target has a leaf at {path_str(path)!r}, the checkpoint has a subtree there "
            f"({len(below)} leaves, e.g. {path_str(below[0])!r})"
        )
    name = path_str(path)
    return TargetMismatchError(
        f"{url}: leaf {name!r} of the target is not in the checkpoint" + _nearest(name, path, saved)
    )


def _nearest(name: str, path: Path, saved: Mapping[Path, Any]) -> str:
    """The saved names closest to `name`: of the entries (leaves or subtrees) beside it,
    else (a misspelt key above it) of every leaf, where there are not too many to compare."""
    k = len(path)
    beside = {path_str(p[:k]) for p in saved if len(p) >= k and p[: k - 1] == path[:-1]}
    close = difflib.get_close_matches(name, sorted(beside), n=5, cutoff=0.0)
    if close:
        return f" (saved beside it, closest first: {', '.join(close)})"
    if len(saved) <= 20_000:
        close = difflib.get_close_matches(name, [path_str(p) for p in saved], n=3, cutoff=0.6)
    return f" (closest saved leaves: {', '.join(close)})" if close else ""


def refuse_empty_containers(url: str, target: Any, names: Iterable[str]) -> None:
    """An empty container of the target where the checkpoint has leaves (`names`) would
    restore none of them, silently: a partial restore leaves the entry out instead."""
    empty = empty_containers(target)
    if not empty:
        return
    names = list(names)
    for path in empty:
        prefix = path_str(path) + "/" if path else ""
        if path_str(path) in names:  # one leaf there (a per-process value, a value)
            raise TargetMismatchError(
                f"{url}: the target has an empty container at {path_str(path)!r}, where the "
                "checkpoint has one leaf (a snapshard.PerProcess value is one leaf, whatever "
                "it holds): give snapshard.PerProcess(None) there, or leave the entry out "
                "of the target to restore the rest without it"
            )
        below = [n for n in names if n.startswith(prefix)]
        if below:
            where = f"has an empty container at {path_str(path)!r}" if path else "is empty"
            raise TargetMismatchError(
                f"{url}: the target {where}, the checkpoint has {len(below)} leaves there "
                f"(e.g. {below[0]!r}); give the target the entries to fill, or leave the entry "
                "out of the target to restore the rest without it (a partial restore)"
            )
