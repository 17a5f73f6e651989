"""A process's node-local copies (jax/local_tier.py): what each holds, and the LocalStore that
writes, lists, trims and reads them.

On disk, under the tier's directory (one per host, e.g. /dev/shm/ckpt):

    process-00003/120/own          process 3's addressable shards at step 120
    process-00003/120/peer-00002   process 2's shards, copied to process 3

Each is an ordinary snapshard checkpoint (atomic, checksummed) of the tree
{"leaves": [entry, ...]}, one entry per leaf of the user's tree in flat order:
{"shards": {"a:b,c:d": array}} for a device array (its unique local boxes) and
{"value": x} for a host array or Python value. Its manifest's `extra` holds the leaf paths
and a fingerprint of every leaf's global layout, so a restore can tell whether the step
fits the target without reading data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..coordination import SingleProcessCoordinator
from ..dtypes import dtype_name
from ..errors import SnapshardError
from ..format.kinds import LeafKind
from ..format.leaves import ArrayLeaf, ValueLeaf
from ..manager.tier_config import LocalTier
from ..options import SaveOptions
from ..planning.layout import Box
from ..reading import ReadStats
from ..reading.restore import build_from_host
from ..saving import finish, prepare
from ..saving.save_array import SaveArray
from ..saving.staging import Snapshot
from ..storage import LocalRoot, LocalStorage
from ..storage.atomic_rename import move_into_place
from ..storage.stale_staging import STAGING_SUFFIX
from ..tree import FlatTree, path_str
from ..tree import Path as TreePath
from .arrays import layout_of
from .load import load

log = logging.getLogger("snapshard")

_SINGLE = SingleProcessCoordinator()
# A node-local copy is small and written beside training: one file, one thread.
_ONE_WRITER = SaveOptions(writers=1)


def box_key(box: Box) -> str:
    return ",".join(f"{a}:{b}" for a, b in zip(*box, strict=True))


def fingerprint(kind: str, shape: tuple[int, ...], sharding: Any) -> str:
    """What must match between a saved leaf and a target leaf to restore it from this tier."""
    h = hashlib.sha256(f"{kind}{shape}".encode())
    if sharding is not None:
        lay = layout_of(tuple(shape), 1, sharding).layout
        for a in (lay.starts, lay.stops, lay.process_ids):
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:24]


def saved_fingerprints(flat: FlatTree) -> dict[str, str]:
    out = {}
    for path, v in zip(flat.paths, flat.leaves, strict=True):
        if isinstance(v, jax.Array):
            out[path_str(path)] = fingerprint("device", tuple(v.shape), v.sharding)
        elif isinstance(v, np.ndarray | np.generic):
            out[path_str(path)] = fingerprint("host", tuple(np.shape(v)), None)
        else:
            out[path_str(path)] = fingerprint("value", (), None)
    return out


def target_fingerprint(t: Any) -> str:
    if isinstance(t, jax.Array) or (
        isinstance(t, jax.ShapeDtypeStruct) and getattr(t, "sharding", None) is not None
    ):
        return fingerprint("device", tuple(t.shape), t.sharding)
    if isinstance(t, np.ndarray | np.generic | jax.ShapeDtypeStruct):
        return fingerprint("host", tuple(np.shape(t)), None)
    return fingerprint("value", (), None)


def local_tree(leaves: Sequence[Any], flat: FlatTree, snapshot: Snapshot) -> dict[str, Any]:
    entries: list[dict[str, Any]] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, SaveArray) and leaf.devices is not None:
            entry: dict[str, Any] = {"shards": {box_key(b): a for b, a in snapshot[i].items()}}
            if leaf.key_impl is not None:
                entry["key_impl"] = leaf.key_impl
            entries.append(entry)
        elif isinstance(leaf, ValueLeaf):
            entries.append({"value": leaf.value})
        else:  # a host array: the caller may change it once save returns
            entries.append({"value": np.array(flat.leaves[i], copy=True)})
    return {"leaves": entries}


class LocalStore:
    """This process's part of the local tier."""

    def __init__(self, tier: LocalTier, process: int, process_count: int):
        self.tier = tier
        self.process = process
        self.process_count = process_count
        self.root = Path(tier.directory) / f"process-{process:05d}"

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    def copy_name(self, owner: int) -> str:
        return "own" if owner == self.process else f"peer-{owner:05d}"

    def write(self, step: int, owner: int, tree: dict[str, Any], extra: dict[str, Any]) -> int:
        """Save `owner`'s local checkpoint of `step` here; returns the bytes written."""
        storage = LocalStorage(self.step_dir(step) / self.copy_name(owner))
        prep = prepare(
            storage,
            tree,
            _ONE_WRITER,
            overwrite=True,
            coordinator=_SINGLE,
            extra={**extra, "owner": owner},
        )
        return finish(prep).bytes_written

    def steps(self) -> list[int]:
        """Steps with a directory here (their copies may still be incomplete)."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())

    def holdings(self, target_fps: dict[str, str]) -> dict[int, list[int]]:
        """{step: processes whose complete data this process holds}, for the steps whose
        saved layout fits the target."""
        out: dict[int, list[int]] = {}
        for step in self.steps():
            for copy, ok in LocalRoot(self.step_dir(step)).list().items():
                if not ok or not (copy == "own" or copy.startswith("peer-")):
                    continue
                try:
                    extra = _read_extra(LocalStorage(self.step_dir(step) / copy))
                except SnapshardError as e:
                    log.warning("local tier: skipping %s: %s", self.step_dir(step) / copy, e)
                    continue
                if extra.get("process_count") != self.process_count:
                    continue
                saved = extra.get("fingerprints", {})
                if all(saved.get(p) == fp for p, fp in target_fps.items()):
                    out.setdefault(step, []).append(int(extra["owner"]))
        return {s: sorted(v) for s, v in out.items()}

    def retain(self, keep: int) -> None:
        """Keep the newest `keep` local steps of this process; remove the rest, and what
        unfinished saves left in the steps kept."""
        steps = self.steps()
        for s in steps[:-keep] if keep > 0 else steps:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)
        for s in steps[-keep:] if keep > 0 else []:
            copies = LocalRoot(self.step_dir(s))
            for name, ok in copies.list().items():
                if not ok:
                    copies.remove_incomplete(name)
        for p in self.root.iterdir() if self.root.is_dir() else ():
            if not p.name.isdigit():  # a step directory being created or removed
                shutil.rmtree(p, ignore_errors=True)

    def pack_files(self, step: int, owner: int) -> np.ndarray:
        """The files of a local checkpoint as one blob: header length, JSON header, contents."""
        d = self.step_dir(step) / self.copy_name(owner)
        names = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
        header = json.dumps([[n, os.path.getsize(d / n)] for n in names]).encode()
        blob = bytearray(struct.pack("<Q", len(header)) + header)
        for n in names:
            blob += (d / n).read_bytes()
        return np.frombuffer(bytes(blob), np.uint8)

    def unpack_files(self, step: int, blob: np.ndarray) -> None:
        """Write a blob from pack_files as this process's own copy of `step` (atomically)."""
        raw = blob.tobytes()
        (hlen,) = struct.unpack("<Q", raw[:8])
        files = json.loads(raw[8 : 8 + hlen])
        final = self.step_dir(step) / "own"
        tmp = final.with_name("own" + STAGING_SUFFIX)
        shutil.rmtree(tmp, ignore_errors=True)
        at = 8 + hlen
        for name, size in files:
            if ".." in Path(name).parts or Path(name).is_absolute():
                raise ValueError(f"unsafe file name {name!r} in peer data")
            p = tmp / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(raw[at : at + size])
            at += size
        move_into_place(tmp, final, replace=True)

    def read_own(self, step: int) -> tuple[dict[str, Any], int]:
        """This process's own local checkpoint of `step`: entries by path string, bytes read."""
        storage = LocalStorage(self.step_dir(step) / "own")
        extra = _read_extra(storage)
        stats = ReadStats()
        data = load(storage, stats=stats)
        paths = [tuple(p) for p in extra["paths"]]
        return {
            path_str(p): e for p, e in zip(paths, data["leaves"], strict=True)
        }, stats.bytes_read


def _read_extra(storage: LocalStorage) -> dict[str, Any]:
    from ..format.reading import read_summary

    with storage:
        return read_summary(storage).extra


def parse_box_key(key: str) -> Box:
    """The inverse of box_key."""
    pairs = [tuple(int(x) for x in part.split(":")) for part in key.split(",")] if key else []
    return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)


def build_from_local(entry: dict[str, Any], target: Any, path: TreePath, where: str) -> Any:
    """A restore-target leaf built from this process's local entry of it, by the builder
    `load` uses (restore.build_from_host): the target's sharding, shape and dtype."""
    if "value" in entry:
        v = entry["value"]
        if not isinstance(v, np.ndarray | np.generic):
            return v  # a Python value
        a = np.asarray(v)
        kind = LeafKind.SCALAR if isinstance(v, np.generic) else LeafKind.ARRAY
        key_impl, shape = None, a.shape
        boxes = {((0,) * a.ndim, a.shape): a}
    else:
        boxes = {parse_box_key(k): a for k, a in entry["shards"].items()}
        a = next(iter(boxes.values()))
        key_impl = entry.get("key_impl")
        kind = LeafKind.PRNG_KEY if key_impl is not None else LeafKind.ARRAY
        # The saved layout is the target's (their fingerprints match); keys add the data axis.
        shape = (*target.shape, a.shape[-1]) if key_impl is not None else tuple(target.shape)
    saved = ArrayLeaf(path, kind, dtype_name(a.dtype), tuple(shape), key_impl=key_impl)
    return build_from_host(saved, target, boxes, where)
