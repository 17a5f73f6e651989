"""`snapshard.load`: match a target to a checkpoint, restore per-process values, and run the
read executor (reading/) over the checkpoint's source (sources.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from . import per_process
from .adapters.iterators import is_data_iterator, restore_iterator
from .adapters.loaded import is_jax_array, is_shape_dtype_struct
from .checksum import crc32c
from .coordination import Coordinator, default_coordinator
from .dtypes import dtype_from_name
from .errors import (
    CorruptCheckpointError,
    TargetMismatchError,
)
from .format import Manifest, ValueLeaf
from .format.leaves import ArrayLeaf, PerProcessLeaf
from .format.naming import values_file_name
from .gc_pause import collection_paused
from .options import ReadOptions, require
from .per_process import PerProcess, Resplit
from .read_once import execute as execute_read_once
from .reading import ReadStats, Request, make_request, with_buffers
from .reading import build as build_request
from .sources import open_source
from .storage import Location, Storage, storage_for
from .tree import (
    Path,
    TargetTree,
    empty_containers,
    flatten_target,
    path_str,
    unflatten,
    warn_lost_classes,
)


def is_target_leaf(x: Any) -> bool:
    return (
        isinstance(x, np.ndarray | np.generic | bool | int | float | str | bytes | PerProcess)
        or is_jax_array(x)
        or is_shape_dtype_struct(x)
        or is_data_iterator(x)
    )


def _is_python_value(x: Any) -> bool:
    return isinstance(x, bool | int | float | str | bytes) and not isinstance(x, np.generic)


def _read_values_file(storage: Storage, manifest: Manifest, q: int) -> dict[int, Any]:
    table = manifest.processes
    assert table is not None and table.values_sizes
    name = values_file_name(q, table.nonces[q])
    buf = bytearray(table.values_sizes[q])
    storage.read_into(name, 0, [memoryview(buf)])
    if crc32c(bytes(buf)) != table.values_crcs[q]:
        raise CorruptCheckpointError(
            f"{storage.url}/{name}: per-process values fail their checksum"
        )
    return per_process.decode_file(bytes(buf), f"{storage.url}/{name}")


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
            if i not in files[q]:
                raise CorruptCheckpointError(
                    f"{url}: process {q} has no value for leaf {leaf.name!r}"
                )
            got.append(per_process.decode(files[q][i], f"{url}, leaf {leaf.name!r}"))
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
    mesh: Any = None,
) -> Any:
    """`target`'s leaf of the saved array `saved`, built as `load` builds it (the target's
    sharding, shape and dtype checked against `saved`) from host data instead of storage:
    `boxes` maps boxes (start, stop) of the saved array to their values, and covers the
    boxes this process holds for the target."""
    req = make_request(saved, target, url, mesh)
    dtype = dtype_from_name(saved.dtype)
    for d in with_buffers(req):
        buf = d.buf.view(dtype).reshape(d.shape)
        for (start, stop), values in boxes.items():
            lo, hi = np.maximum(d.start, start), np.minimum(d.stop, stop)
            if np.all(hi > lo):  # the overlap of the box and the buffer
                into = tuple(map(slice, lo - d.start, hi - d.start))
                src = tuple(map(slice, lo - np.asarray(start), hi - np.asarray(start)))
                buf[into] = np.asarray(values, dtype=dtype)[src]
    return build_request(req)


def missing_target_leaf(url: str, path: Path, saved: Mapping[Path, Any]) -> TargetMismatchError:
    """The error for a target leaf at `path` that the checkpoint (leaves `saved`) lacks: it
    names the subtree saved there, or the leaves saved beside it."""
    below = [p for p in saved if p[: len(path)] == path]
    if below:
        return TargetMismatchError(
            f"{url}: the target has a leaf at {path_str(path)!r}, the checkpoint has a subtree there "
            f"({len(below)} leaves, e.g. {path_str(below[0])!r})"
        )
    near = sorted(path_str(p) for p in saved if p[:-1] == path[:-1])[:5]
    return TargetMismatchError(
        f"{url}: leaf {path_str(path)!r} of the target is not in the checkpoint"
        + (f" (saved leaves beside it: {', '.join(near)})" if near else "")
    )


def refuse_empty_containers(url: str, target: Any, names: Iterable[str]) -> None:
    """An empty container of the target where the checkpoint has leaves (`names`) would
    restore none of them, silently: a partial restore leaves the entry out instead."""
    empty = empty_containers(target)
    if not empty:
        return
    names = list(names)
    for path in empty:
        prefix = path_str(path) + "/" if path else ""
        below = [n for n in names if n.startswith(prefix)]
        if below:
            where = f"has an empty container at {path_str(path)!r}" if path else "is empty"
            raise TargetMismatchError(
                f"{url}: the target {where}, the checkpoint has {len(below)} leaves there "
                f"(e.g. {below[0]!r}); give the target the entries to fill, or leave the entry "
                "out of the target to restore the rest without it (a partial restore)"
            )


def _match_target(manifest: Manifest, target: Any, url: str) -> TargetTree:
    """The target's leaves by path, each checked to be in the checkpoint."""
    refuse_empty_containers(url, target, (leaf.name for leaf in manifest.leaves))
    tree = flatten_target(target, is_target_leaf)
    saved = manifest.leaf_by_path()
    for path in tree.paths:
        if path not in saved:
            raise missing_target_leaf(url, path, saved)
    return tree


@collection_paused()
def load(
    directory: Location | Storage,
    target: Any = None,
    options: ReadOptions = ReadOptions(),
    *,
    stats: ReadStats | None = None,
    resplit: Resplit | None = None,
    mesh: Any = None,
) -> Any:
    """Restore a checkpoint.

    target=None: the saved tree as NumPy arrays (typed PRNG keys as jax key arrays) and Python
    values, in plain containers. Otherwise a pytree whose leaves say what to build:
    ShapeDtypeStruct with a sharding or a jax.Array (a jax.Array on that sharding), an
    np.ndarray or ShapeDtypeStruct without sharding (NumPy). Leaves the target omits are not
    read; a differing dtype is cast on the host. Leaves saved as snapshard.PerProcess come
    back as each process's own value (`resplit` re-splits them onto another process count).
    A checkpoint written by Orbax is read the same way, through TensorStore (see
    docs/migrating-from-orbax.md). Target shardings on an AbstractMesh (eval_shape under
    jax.set_mesh) are placed on `mesh`, or else on the mesh in context.

    `options` (snapshard.ReadOptions): checksums, read threads, the host-memory budget,
    and read-once restores of replicated targets in multi-process jobs. `stats`, when
    given, is filled with what the restore read and how long it took.
    """
    require(options, ReadOptions)
    t_start = time.perf_counter()
    stats = stats if stats is not None else ReadStats()
    owns_storage = not isinstance(directory, Storage)
    storage = storage_for(directory)
    try:
        source = open_source(storage, options)
        manifest, url = source.manifest, storage.url
        if target is None:
            pairs = [(leaf.path, None) for leaf in manifest.leaves]
            matched = None
        else:
            matched = _match_target(manifest, target, url)
            pairs = list(zip(matched.paths, matched.leaves, strict=True))
        results, reqs = _values_and_requests(storage, manifest, pairs, resplit, mesh)
        built = execute_read_once([r for _, r in reqs], source, options, stats, location=url)
        results.update(zip([p for p, _ in reqs], built, strict=True))
    finally:
        if owns_storage:
            storage.close()
    stats.total_s = time.perf_counter() - t_start
    if matched is None:
        by_index: Callable[[int], Any] = lambda i: results[manifest.leaves[i].path]  # noqa: E731
        warn_lost_classes(manifest.structure)
        return unflatten(manifest.structure, by_index)
    return matched.rebuild(results)


def _values_and_requests(
    storage: Storage,
    manifest: Manifest,
    pairs: list[tuple[Path, Any]],
    resplit: Resplit | None,
    mesh: Any,
) -> tuple[dict[Path, Any], list[tuple[Path, Request]]]:
    """For the (path, target leaf) pairs to restore: the values known without reading
    arrays (Python values, per-process values, data iterators moved to their saved
    position), and a read request per array."""
    url = storage.url
    saved = manifest.leaf_by_path()
    results: dict[Path, Any] = {}
    reqs: list[tuple[Path, Request]] = []
    own = [saved[p] for p, _ in pairs if isinstance(saved[p], PerProcessLeaf)]
    results.update(per_process_values(storage, manifest, own, resplit))  # type: ignore[arg-type]
    for path, t in pairs:
        leaf = saved[path]
        if isinstance(leaf, PerProcessLeaf):
            if is_data_iterator(t):  # a data iterator in the target moves to its saved position
                results[path] = restore_iterator(t, results[path], leaf=path_str(path))
            continue
        if isinstance(leaf, ValueLeaf):
            if t is not None and not _is_python_value(t):
                raise TargetMismatchError(
                    f"{url}: leaf {leaf.name!r} is a saved {type(leaf.value).__name__} value, not an array"
                )
            results[path] = leaf.value
        else:
            if _is_python_value(t):
                raise TargetMismatchError(
                    f"{url}: leaf {leaf.name!r} is a saved array, the target has a Python value"
                )
            reqs.append((path, make_request(leaf, t, url, mesh)))
    return results, reqs
