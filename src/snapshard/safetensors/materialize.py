"""From destination boxes of lazy arrays to the reads of the restore executor.

The restore executor fills host buffers (its `Dest`s: a leaf, a box, a buffer) from the
chunks of the leaf. A stored or composite array's leaf has its stored pieces as chunks, so
its buffers are read directly. Derived arrays, and derived pieces of composites, get a
scratch buffer for the box of their child they need, and a step that computes their own
bytes from it once the reads are done: children's steps run before their parents'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ..dtypes import dtype_from_name
from ..format import ArrayLeaf
from ..reading import Dest, aligned_empty
from ..transforms.virtual import Composite, Derived, Stored, VArray, leaf_of

Step = Callable[[], None]


def _view(d: Dest) -> np.ndarray:
    return d.buf.view(dtype_from_name(d.leaf.dtype)).reshape(d.shape)


class Planner:
    """Leaves for lazy arrays, and the expansion of their destination buffers."""

    def __init__(self) -> None:
        self._nodes: dict[int, tuple[ArrayLeaf, VArray]] = {}  # holds the leaves alive
        self._leaves: dict[int, ArrayLeaf] = {}  # by id of a lazy array the caller holds

    def leaf(self, name: str, x: VArray) -> ArrayLeaf:
        """A leaf of its own for every buffer set: the executor merges the runs of one leaf's
        buffers per chunk and needs them disjoint, which buffers of different requests or
        parents are not (a tensor used twice, scratch boxes of neighbouring shards)."""
        base = self._leaves.get(id(x))
        if base is None:
            base = self._leaves[id(x)] = leaf_of(name, x)
        leaf = dataclasses.replace(base)
        self._nodes[id(leaf)] = (leaf, x)
        return leaf

    def expand(self, dests: list[Dest]) -> tuple[list[Dest], list[Step]]:
        reads: list[Dest] = []
        steps: list[Step] = []
        for d in dests:
            self._expand(d, reads, steps)
        return reads, steps

    def _scratch(self, name: str, x: VArray, start: np.ndarray, stop: np.ndarray) -> Dest:
        leaf = self.leaf(name, x)
        nbytes = int(np.prod(stop - start, dtype=np.int64)) * x.dtype.itemsize
        return Dest(leaf, start, stop, aligned_empty(nbytes))

    def _expand(self, d: Dest, reads: list[Dest], steps: list[Step]) -> None:
        _, x = self._nodes[id(d.leaf)]
        name = d.leaf.name
        if isinstance(x, Stored):
            reads.append(d)
        elif isinstance(x, Composite):
            self._expand_composite(d, x, reads, steps)
        else:
            assert isinstance(x, Derived)
            self._expand_derived(d, x, reads, steps, name)

    def _expand_composite(
        self, d: Dest, x: Composite, reads: list[Dest], steps: list[Step]
    ) -> None:
        direct = False
        for p in x.pieces:
            lo = np.maximum(np.asarray(p.lo, np.int64), d.start)
            hi = np.minimum(np.asarray(p.hi, np.int64), d.stop)
            if np.any(hi <= lo):
                continue
            if isinstance(p.child, Stored):
                direct = True
                continue
            at = np.asarray(p.at, np.int64)
            sub = self._scratch(d.leaf.name, p.child, lo - at, hi - at)
            self._expand(sub, reads, steps)
            where = tuple(
                slice(int(a), int(b)) for a, b in zip(lo - d.start, hi - d.start, strict=True)
            )

            def copy(d: Dest = d, sub: Dest = sub, where: tuple[slice, ...] = where) -> None:
                _view(d)[where] = _view(sub)

            steps.append(copy)
        if direct:
            reads.append(d)

    def _expand_derived(
        self, d: Dest, x: Derived, reads: list[Dest], steps: list[Step], name: str
    ) -> None:
        child = x.child
        assert child is not None
        if x.kind == "transpose":
            start = np.empty_like(d.start)
            stop = np.empty_like(d.stop)
            start[list(x.perm)], stop[list(x.perm)] = d.start, d.stop
            sub = self._scratch(name, child, start, stop)
            fill: Callable[[np.ndarray], np.ndarray] = lambda a: a.transpose(x.perm)  # noqa: E731
        elif x.kind == "cast":
            sub = self._scratch(name, child, d.start, d.stop)
            fill = lambda a: a.astype(x.dtype)  # noqa: E731
        else:
            start, stop, mid, where = reshape_source_box(child.shape, x.shape, d.start, d.stop)
            sub = self._scratch(name, child, start, stop)
            fill = lambda a: a.reshape(mid)[where]  # noqa: E731
        self._expand(sub, reads, steps)

        def compute(d: Dest = d, sub: Dest = sub) -> None:
            _view(d)[...] = fill(_view(sub))

        steps.append(compute)


def _groups(src: tuple[int, ...], out: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Consecutive axes of src and out with equal products (the axes a reshape merges/splits)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(out):
        gi, gj = [i], [j]
        pi, pj = src[i], out[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= src[i]
                gi.append(i)
                i += 1
            else:
                pj *= out[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    if not groups:
        groups.append(([], []))
    groups[-1][0].extend(range(i, len(src)))
    groups[-1][1].extend(range(j, len(out)))
    return groups


def reshape_source_box(
    src: tuple[int, ...], out: tuple[int, ...], start: np.ndarray, stop: np.ndarray
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...], tuple[slice, ...]]:
    """The box of the source to read for box [start, stop) of its reshape to `out`.

    Per group of merged/split axes the box is exact when the output box is one contiguous
    range there that is also a box of the source (shards along the outer axis of a group, or
    a group held whole); otherwise the group is read whole and sliced (an over-read).
    Returns (source start, source stop, shape to view the read bytes as, slices of it).
    """
    s_start, s_stop = np.zeros(len(src), np.int64), np.zeros(len(src), np.int64)
    mid: list[int] = []
    where: list[slice] = []
    if 0 in src:
        return s_start, s_stop, tuple(int(e - s) for s, e in zip(start, stop, strict=True)), ()
    for gi, gj in _groups(src, out):
        o_shape = [out[a] for a in gj]
        i_shape = [src[a] for a in gi]
        lo = [int(start[a]) for a in gj]
        hi = [int(stop[a]) for a in gj]
        ext = [b - a for a, b in zip(lo, hi, strict=True)]
        f0 = int(np.ravel_multi_index(lo, o_shape)) if gj else 0
        f1 = int(np.ravel_multi_index([b - 1 for b in hi], o_shape)) + 1 if gj else 1
        exact = f1 - f0 == int(np.prod(ext, dtype=np.int64))
        if exact and gi:
            a = np.unravel_index(f0, i_shape)
            b = np.unravel_index(f1 - 1, i_shape)
            box = [int(y) - int(x) + 1 for x, y in zip(a, b, strict=True)]
            exact = (
                all(y >= x for x, y in zip(a, b, strict=True))
                and int(np.prod(box, dtype=np.int64)) == f1 - f0
            )
        if exact:
            if gi:
                s_start[gi] = np.unravel_index(f0, i_shape)
                s_stop[gi] = np.asarray(np.unravel_index(f1 - 1, i_shape)) + 1
            mid += ext
            where += [slice(None)] * len(gj)
        else:
            s_start[gi], s_stop[gi] = 0, i_shape
            mid += o_shape
            where += [slice(a, b) for a, b in zip(lo, hi, strict=True)]
    return s_start, s_stop, tuple(mid), tuple(where)
