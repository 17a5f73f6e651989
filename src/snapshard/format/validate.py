"""Checks of a manifest: cheap structural checks on every read, and the full coverage check
(every array tiled by its chunks exactly once) before a save commits."""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import NAME_TO_DTYPE
from ..errors import CorruptCheckpointError, ValidationError
from ..planning.overlaps import ChunkIndex
from .bounds import MAX_BYTES, MAX_DEPTH
from .chunk_checks import box_text, check_chunks, stored_extents
from .chunks import ChunkTable, concat_optional
from .kinds import LeafKind
from .leaves import KEY_TYPES, ArrayLeaf, PerProcessLeaf
from .manifest import Manifest

_MAX_GRID_CELLS = 1 << 24
_MAX_REPORTED = 4


_CONTAINERS = frozenset(("dict", "list", "tuple", "namedtuple", "node"))
_KEYED = frozenset(("dict", "namedtuple", "node"))


def _check_tree(m: Manifest, where: str) -> None:
    """One walk of the tree, without recursion: node types, unique keys, bounded depth, and
    every leaf of the list referenced once, at the path its entry states (keys of dict-like
    nodes, positions in lists and tuples), so that a leaf can never take another's place.

    Paths hold str and int keys only (the leaf entries' and the tree's are checked for it),
    which are equal only when of one type: `==` is the whole comparison. A leaf node is
    checked where its parent is walked, not stacked: a manifest may have 100,000."""
    leaves = m.leaves
    seen = bytearray(len(leaves))
    stack: list[tuple[object, tuple[object, ...]]] = [(m.structure, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            raise CorruptCheckpointError(f"{where}: malformed tree node")
        t = node.get("t")
        if t == "leaf":
            _check_leaf_node(node, path, leaves, seen, where)
            continue
        kids = node.get("c", [])
        if t not in _CONTAINERS or not isinstance(kids, list):
            raise CorruptCheckpointError(f"{where}: malformed tree node of type {str(t)[:50]!r}")
        if kids and len(path) >= MAX_DEPTH:
            raise CorruptCheckpointError(f"{where}: the tree is nested more than {MAX_DEPTH} deep")
        keys: list[object] | range
        if t in _KEYED:
            keys = node.get("k")  # type: ignore[assignment]
            if not isinstance(keys, list) or len(keys) != len(kids):
                raise CorruptCheckpointError(f"{where}: a {t} node's keys and children disagree")
            if not KEY_TYPES.issuperset(map(type, keys)):
                raise CorruptCheckpointError(f"{where}: malformed key in a {t} node")
            if len(set(keys)) != len(keys):
                raise CorruptCheckpointError(f"{where}: duplicate key in a {t} node")
        else:
            keys = range(len(kids))
        for k, child in zip(keys, kids, strict=True):
            if type(child) is dict and child.get("t") == "leaf":
                _check_leaf_node(child, (*path, k), leaves, seen, where)
            else:
                stack.append((child, (*path, k)))
    if seen.count(0):
        raise CorruptCheckpointError(f"{where}: the tree structure and the leaf list disagree")


def _check_leaf_node(
    node: dict, path: tuple[object, ...], leaves: list, seen: bytearray, where: str
) -> None:
    i = node.get("i")
    if type(i) is not int:
        raise CorruptCheckpointError(f"{where}: malformed leaf reference")
    if not 0 <= i < len(leaves) or seen[i]:
        raise CorruptCheckpointError(f"{where}: the tree structure and the leaf list disagree")
    seen[i] = 1
    leaf_path = leaves[i].path
    if leaf_path != path:
        raise CorruptCheckpointError(
            f"{where}: leaf {i} has path {'/'.join(map(str, leaf_path))[:200]!r}, the "
            f"tree holds it at {'/'.join(map(str, path))[:200]!r}"
        )


def _check_per_process_table(m: Manifest, where: str) -> None:
    """Leaves saved per process have their values files listed (v2)."""
    own = [leaf for leaf in m.leaves if isinstance(leaf, PerProcessLeaf)]
    if own and (m.processes is None or not m.processes.values_sizes):
        raise CorruptCheckpointError(
            f"{where}, leaf {own[0].name!r}: a value saved per process, but the manifest lists "
            "no per-process values files"
        )


def _check_chunk_counts(m: Manifest, where: str) -> None:
    """An array has chunks if and only if it has elements (before any record is read)."""
    for leaf in m.arrays:
        n = leaf.chunk_count if m.version >= 2 else len(leaf.chunks)
        empty = math.prod(leaf.shape) == 0
        if (n == 0) != empty:
            raise CorruptCheckpointError(
                f"{where}, leaf {leaf.name!r}: {n} chunks for an array of shape {leaf.shape}"
            )


def validate_structure(m: Manifest, where: str) -> None:
    """Everything a reader relies on, before anything is allocated or read: the tree, leaf
    references, unique paths, dtypes, and (v1) chunk and file bounds; (v2) layout numbers
    and that the arrays fit the bytes the files hold."""
    _check_tree(m, where)
    _check_per_process_table(m, where)
    paths = [leaf.path for leaf in m.leaves]
    if len(set(paths)) != len(paths):
        seen: set[object] = set()
        dup = next(p for p in paths if p in seen or seen.add(p))  # type: ignore[func-returns-value]
        raise CorruptCheckpointError(
            f"{where}: leaf path {'/'.join(map(str, dup))!r} is listed twice"
        )
    sizes = [f.size for f in m.files]
    stored = sum(sizes)
    if m.total_bytes > min(stored, MAX_BYTES) and not m.codecs:  # compressed: per chunk
        raise CorruptCheckpointError(
            f"{where}: the arrays need {m.total_bytes} bytes, the data files hold {stored}"
        )
    n_layouts, v2 = len(m.layouts), m.version >= 2
    for leaf in m.arrays:
        if v2:
            if leaf.layout is None or not 0 <= leaf.layout < n_layouts:
                raise CorruptCheckpointError(
                    f"{_at(where, leaf)}: layout {leaf.layout} is not in the manifest"
                )
            if leaf.writers is not None and any(w >= m.process_count for w in leaf.writers):
                raise CorruptCheckpointError(f"{_at(where, leaf)}: writer beyond the process count")
        dt = NAME_TO_DTYPE.get(leaf.dtype)
        if dt is None:
            raise CorruptCheckpointError(f"{_at(where, leaf)}: unknown dtype {leaf.dtype!r}")
        if leaf.kind == LeafKind.PRNG_KEY:
            if not leaf.key_impl or not leaf.shape:
                raise CorruptCheckpointError(
                    f"{_at(where, leaf)}: PRNG key without implementation or key-data axis"
                )
            _check_key_data(leaf, _at(where, leaf))
        elif leaf.kind == LeafKind.SCALAR and leaf.shape:
            raise CorruptCheckpointError(f"{_at(where, leaf)}: a scalar with shape {leaf.shape}")
        if m.version == 1:
            check_chunks(leaf, leaf.chunks, dt.itemsize, sizes, _at(where, leaf))
    _check_chunk_counts(m, where)


def _at(where: str, leaf: ArrayLeaf) -> str:
    """Where a problem of `leaf` is (made on error only: a manifest has many leaves)."""
    return f"{where}, leaf {leaf.name!r}"


# The key data of the PRNG implementations JAX ships: (dtype, size of the key-data axis).
_KEY_DATA = {"threefry2x32": ("uint32", 2), "rbg": ("uint32", 4), "unsafe_rbg": ("uint32", 4)}


def _check_key_data(leaf: ArrayLeaf, name: str) -> None:
    """A typed key's stored data fits its implementation (JAX would refuse it with a bare
    TypeError at the end of the restore)."""
    want = _KEY_DATA.get(str(leaf.key_impl))
    if want is None:
        raise CorruptCheckpointError(
            f"{name}: unknown PRNG implementation {str(leaf.key_impl)[:100]!r} (this version "
            f"rebuilds {', '.join(_KEY_DATA)})"
        )
    if (leaf.dtype, leaf.shape[-1]) != want:
        raise CorruptCheckpointError(
            f"{name}: {leaf.key_impl} keys need {want[0]} key data of {want[1]} words, the "
            f"checkpoint has {leaf.dtype} of shape {leaf.shape}"
        )


def coverage_problems(
    shape: tuple[int, ...], starts: np.ndarray, stops: np.ndarray
) -> tuple[list[str], list[str]]:
    """Boxes of `shape` covered by no chunk, and boxes covered by more than one (a few of each)."""
    nd = len(shape)
    if math.prod(shape) == 0:
        return [], []
    if nd == 0:
        n = len(starts)
        return (["[]"] if n == 0 else []), (["[]"] if n > 1 else [])
    bounds = [
        np.unique(np.concatenate([[0, shape[a]], starts[:, a], stops[:, a]])) for a in range(nd)
    ]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells > _MAX_GRID_CELLS:
        return _coverage_by_index(shape, starts, stops)
    count = np.zeros(tuple(len(b) - 1 for b in bounds), dtype=np.int32)
    lo = np.stack([np.searchsorted(bounds[a], starts[:, a]) for a in range(nd)], axis=1)
    hi = np.stack([np.searchsorted(bounds[a], stops[:, a]) for a in range(nd)], axis=1)
    for i in range(len(starts)):
        count[tuple(slice(int(a), int(b)) for a, b in zip(lo[i], hi[i], strict=True))] += 1

    def boxes(mask: np.ndarray) -> list[str]:
        out = []
        for cell in np.argwhere(mask)[:_MAX_REPORTED]:
            s = np.array([bounds[a][c] for a, c in enumerate(cell)])
            e = np.array([bounds[a][c + 1] for a, c in enumerate(cell)])
            out.append(box_text(s, e))
        return out

    return boxes(count == 0), boxes(count > 1)


def _coverage_by_index(
    shape: tuple[int, ...], starts: np.ndarray, stops: np.ndarray
) -> tuple[list[str], list[str]]:
    """For tilings too fine for a grid: pairwise overlaps through the index, then the volume."""
    idx = ChunkIndex(starts, stops)
    overlaps = []
    for i in range(len(starts)):
        for j in idx.overlapping(starts[i], stops[i]):
            if j > i:
                s, e = np.maximum(starts[i], starts[j]), np.minimum(stops[i], stops[j])
                overlaps.append(box_text(s, e))
                if len(overlaps) >= _MAX_REPORTED:
                    return [], overlaps
    if overlaps:
        return [], overlaps
    covered = int(np.prod(stops - starts, axis=1, dtype=np.int64).sum())
    missing = math.prod(shape) - covered
    return ([f"{missing} elements (boxes not listed for this many chunks)"] if missing else []), []


def validate_coverage(m: Manifest, where: str) -> None:
    """Every array tiled exactly once by its chunks; no two chunks share bytes of a file."""
    for leaf in m.arrays:
        t = leaf.chunks
        if len(t) == 1 and not t.starts.any() and tuple(t.stops[0].tolist()) == leaf.shape:
            continue  # one chunk, the whole array (most small arrays): nothing to count
        missing, overlapping = coverage_problems(leaf.shape, t.starts, t.stops)
        if missing or overlapping:
            parts = []
            if missing:
                parts.append("missing boxes " + ", ".join(missing))
            if overlapping:
                parts.append("boxes written more than once " + ", ".join(overlapping))
            raise ValidationError(
                f"{where}: array {leaf.name!r} of shape {leaf.shape}: " + "; ".join(parts)
            )
    _check_file_spans(m, where)


def _check_file_spans(m: Manifest, where: str) -> None:
    """No two chunks share bytes of a file (their data, and v2 their checksum tables): all
    spans of all arrays sorted by (file, start), each compared with the next (two spans
    that overlap leave an overlapping pair next to each other)."""
    arrays = m.arrays
    tables = [leaf.chunks for leaf in arrays]
    counts = [len(t) for t in tables]
    if not sum(counts):
        return
    owner = np.repeat(np.arange(len(tables)), counts)
    column = lambda name: np.concatenate([getattr(t, name) for t in tables])  # noqa: E731
    v2 = all(t.crc_offset is not None for t in tables)  # else data spans only, as for v1
    no_box = np.zeros((len(owner), 0), np.int64)
    merged = ChunkTable(
        no_box, no_box, column("file"), column("offset"), column("nbytes"), column("block"), [],
        column("crc_offset") if v2 else None, concat_optional([t.flags for t in tables], counts),
    )  # fmt: skip
    data_end, table_end = stored_extents(merged)
    file, begin, end, who = [merged.file], [merged.offset], [data_end], [owner]
    if merged.crc_offset is not None:
        file.append(merged.file)
        begin.append(merged.crc_offset)
        end.append(table_end)
        who.append(owner)
    f, b, e, o = (np.concatenate(x) for x in (file, begin, end, who))
    order = np.lexsort((e, b, f))
    f, b, e, o = f[order], b[order], e[order], o[order]
    clash = np.flatnonzero((f[1:] == f[:-1]) & (b[1:] < e[:-1]))
    if len(clash):
        k = int(clash[0])
        raise ValidationError(
            f"{where}: file {m.files[int(f[k])].name!r}: bytes {int(b[k + 1])}..{int(e[k])} "
            f"belong to both {arrays[int(o[k])].name!r} and {arrays[int(o[k + 1])].name!r}"
        )
