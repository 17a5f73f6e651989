"""Retention with incremental steps: never delete a file that a kept step refers to.

A step that retention drops is deleted whole when no kept step refers to its files.
Otherwise it is *retained for references*: first a marker `RETAINED` is written into it
(from then on the manager no longer lists it as a step), then the files of it that no kept
step needs are deleted (its records, values and unreferenced data files); its manifest and
the referenced data files stay, under its name, where the references point. Each later
retention pass deletes retained steps that no kept step needs any more, and trims the
others. A crash between any two of these operations leaves every kept step whole: only
files no kept step names are ever deleted, and the marker comes first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Iterable
from typing import Any

from ..format.manifest import Manifest
from ..format.naming import RETAINED_MARKER
from ..format.reading import read_manifest
from ..format.refs import referenced_files
from ..frameworks import is_jax_array
from ..storage import CheckpointRoot, Storage
from ..storage.atomic_rename import fsync_dir
from ..storage.local import LocalStorage
from ..tree import FlatTree, Path

log = logging.getLogger("snapshard")


def _mark_retained(storage: Storage) -> None:
    if isinstance(storage, LocalStorage):
        path = storage.final / RETAINED_MARKER
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(storage.final)
        return
    storage.client.put(RETAINED_MARKER, b"")  # type: ignore[attr-defined]


def _own_files(storage: Storage) -> set[str]:
    """The data, record and values files a checkpoint itself holds. Its manifest is read
    without checking its own bases: a retained step only holds files, and the checkpoints
    it referred to may be gone (a new process revisits every retained step)."""
    m = Manifest.from_json(storage.read_manifest(), storage.url)
    t = m.processes
    if t is None:
        return set()
    out = {f.name for f in t.files()}
    out |= {t.record_name(q) for q in range(len(t))}
    if t.values_sizes:
        from ..format.naming import values_file_name

        out |= {
            values_file_name(q, n)
            for q, (n, size) in enumerate(zip(t.nonces, t.values_sizes, strict=True))
            if size
        }
    return out


def _delete_files(storage: Storage, names: Iterable[str]) -> None:
    names = sorted(names)
    if not names:
        return
    if isinstance(storage, LocalStorage):
        for n in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(storage.final / n)
        return
    storage.client.delete(names)  # type: ignore[attr-defined]


_NO_REFS: frozenset[tuple[str, str]] = frozenset()


class References:
    """Which files of which checkpoints the kept steps of a root refer to."""

    def __init__(self, root: CheckpointRoot):
        self.root = root
        self._refs: dict[str, frozenset[tuple[str, str]]] = {}  # step -> (checkpoint, file)
        self._trimmed: dict[str, frozenset[str]] = {}  # retained step -> files it kept

    def saved_whole(self, name: str) -> None:
        """Step `name` was just saved by this process without a base: it refers to no other
        checkpoint, which retention then knows without reading its manifest back (a parse
        of the whole manifest and its chunk tables after every save, for nothing)."""
        self._refs[name] = _NO_REFS

    def refs_of(self, name: str) -> frozenset[tuple[str, str]]:
        got = self._refs.get(name)
        if got is None:
            with self.root.child(name) as storage:
                refs = referenced_files(read_manifest(storage).refs)
            got = self._refs[name] = frozenset(refs) if refs else _NO_REFS
        return got

    def needed(self, kept: Iterable[str]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for name in kept:
            for cp, file in self.refs_of(name):
                out.setdefault(cp, set()).add(file)
        return out

    def remove(self, doomed: Iterable[str], kept: Iterable[str], retained: set[str]) -> None:
        """Delete `doomed` steps (retaining those still referenced) and revisit the
        retained ones; `retained` is updated in place."""
        need = self.needed(kept)
        for name in [*doomed, *sorted(retained)]:
            self._refs.pop(name, None)
            files = frozenset(need.get(name, ()))
            if name in retained and self._trimmed.get(name) == files:
                continue  # nothing changed for it since the last pass
            storage = self.root.child(name)
            with storage:
                if not files:
                    storage.delete()
                    retained.discard(name)
                    self._trimmed.pop(name, None)
                    continue
                if name not in retained:
                    _mark_retained(storage)
                    retained.add(name)
                    log.info("%s: step %s retained for references", self.root.url, name)
                _delete_files(storage, _own_files(storage) - files)
                self._trimmed[name] = files


def saved_arrays(flat: FlatTree) -> dict[Path, weakref.ref[Any]]:
    """Weak references to the jax.Arrays of a saved tree, by path: the identity shortcut of
    incremental saves (the manager never keeps an array alive for it)."""
    return {
        p: weakref.ref(x) for p, x in zip(flat.paths, flat.leaves, strict=True) if is_jax_array(x)
    }


def identical_leaves(flat: FlatTree, saved: dict[Path, weakref.ref[Any]]) -> frozenset[int]:
    """Leaves that are the very jax.Array objects of `saved` (immutable: the same bytes)."""
    out = set()
    for i, (p, x) in enumerate(zip(flat.paths, flat.leaves, strict=True)):
        ref = saved.get(p)
        obj = ref() if ref is not None else None
        if obj is not None and obj is x and not obj.is_deleted():
            out.add(i)
    return frozenset(out)
