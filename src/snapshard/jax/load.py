"""`snapshard.load`: match a target to a checkpoint, restore per-process values, and run the
read executor (reading/) over the checkpoint's source (reading/sources.py)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from ..coordination import default_coordinator
from ..errors import TargetMismatchError
from ..format import Manifest, ValueLeaf
from ..format.leaves import PerProcessLeaf
from ..gc_pause import collection_paused
from ..iterators import is_data_iterator, restore_iterator
from ..options import ReadOptions
from ..per_process import Resplit
from ..reading import ReadStats, Request, make_request
from ..reading.read_once_policy import refuse_target
from ..reading.restore import (
    is_target_leaf,
    missing_target_leaf,
    per_process_values,
    refuse_empty_containers,
    values_saved_elsewhere,
)
from ..reading.sources import open_for_load
from ..storage import Location, Storage
from ..tree import ABSENT, Path, TargetTree, flatten_target, path_str, unflatten, warn_lost_classes
from .read_once import execute as execute_read_once


def _own_load(target: Any) -> bool:
    """A load of this process's own: no target (the saved tree as NumPy) or one that asks
    for no jax.Array (global: every process loads those together). One process may look
    into a checkpoint by itself. (Asked of a target refused before its requests were made;
    the requests' shardings say the same of one that was not.)"""
    jax = sys.modules.get("jax")  # (not imported: the target holds no jax.Array)
    if jax is None or target is None:
        return True
    return all(getattr(x, "sharding", None) is None for x in jax.tree_util.tree_leaves(target))


def _is_python_value(x: Any) -> bool:
    return isinstance(x, bool | int | float | str | bytes) and not isinstance(x, np.generic)


def _match_target(manifest: Manifest, target: Any, url: str) -> TargetTree:
    """The target's leaves by their paths in the checkpoint, each checked to be there. A
    target's int dict key matches a saved key of its text where nothing else does, as Orbax
    matches them (it saves every dict key as text: an optax state's, an nnx.List's)."""
    refuse_empty_containers(url, target, (leaf.name for leaf in manifest.leaves))
    tree = flatten_target(target, is_target_leaf)
    saved = manifest.leaf_by_path()
    as_text: dict[Path, Path] | None = None
    paths = []
    for path in tree.paths:
        if path not in saved:
            if as_text is None:
                as_text = {_text(p): p for p in saved}
            found = as_text.get(_text(path))
            if found is None:
                raise missing_target_leaf(url, path, saved)
            path = found
        paths.append(path)
    if as_text is None:
        return tree
    rebuild, pairs = tree.rebuild, list(zip(tree.paths, paths, strict=True))
    return TargetTree(paths, tree.leaves, lambda values: rebuild({o: values[p] for o, p in pairs}))


def _text(path: Path) -> Path:
    return tuple(str(k) for k in path)


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
    stats = stats if stats is not None else ReadStats()

    def refused(url: str, e: Exception) -> NoReturn:
        """The other processes learn it rather than wait for this one (a global load)."""
        if _own_load(target):
            raise e
        refuse_target(url, options.read_once, default_coordinator(), options.timeout_s, e)

    with open_for_load(directory, options, stats, refused) as (storage, source, _):
        manifest, url = source.manifest, storage.url
        try:
            if target is None:
                coord = default_coordinator()
                absent = values_saved_elsewhere(manifest, coord.process_index, coord.process_count)
                pairs = [(x.path, None) for i, x in enumerate(manifest.leaves) if i not in absent]
                matched = None
            else:
                matched = _match_target(manifest, target, url)
                pairs = list(zip(matched.paths, matched.leaves, strict=True))
            results, reqs = _values_and_requests(storage, manifest, pairs, resplit, mesh)
        except Exception as e:
            refused(url, e)
        if all(r.sharding is None for _, r in reqs):  # NumPy only: nothing to wait for
            options = dataclasses.replace(options, read_once=False)
        built = execute_read_once([r for _, r in reqs], source, options, stats, location=url)
        results.update(zip([p for p, _ in reqs], built, strict=True))
    if matched is None:
        by_index: Callable[[int], Any] = lambda i: results.get(manifest.leaves[i].path, ABSENT)  # noqa: E731
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
                    f"{url}: leaf {leaf.name!r} is a saved {type(leaf.value).__name__} value, not "
                    "an array: give a Python value there in the target (or leave the leaf out)"
                )
            results[path] = leaf.value
        else:
            if _is_python_value(t):
                raise TargetMismatchError(
                    f"{url}: leaf {leaf.name!r} is a saved array, the target has a Python value"
                )
            reqs.append((path, make_request(leaf, t, url, mesh)))
    return results, reqs
