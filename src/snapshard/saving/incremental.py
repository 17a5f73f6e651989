"""Incremental saves: chunks equal to the base checkpoint's chunk of the same box are recorded
as references to the file that holds the bytes instead of being written again.

Equality is proven, never assumed, in one of two ways:

- **content hash**: while a chunk's bytes are on the host, its 128-bit hash (xxh3-128 where
  the `xxhash` package is installed, else blake2b-128) is computed and compared with the
  hash the base recorded for the chunk of the same leaf path, dtype and box (record files
  with the FILE_HASHES flag, see docs/format.md). Both must use the same hash function.
- **identity** (CheckpointManager only): the leaf is the very same `jax.Array` object the
  manager saved in the base step, and that step is still committed. jax.Arrays are
  immutable, so its bytes are those the base holds; nothing is hashed.

References name the checkpoint that really holds the bytes (a base's own reference is copied,
never chained), always a committed sibling under the same parent.

The list of files a save may refer to follows from the base's manifest alone, so every
process numbers them alike without talking: the base's used references, then the base's
own data files. Slots no process used are written as null.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, SnapshardError
from ..format import records as rec
from ..format.files import FileEntry
from ..format.finder import ChunkFinder
from ..format.leaves import ArrayLeaf
from ..format.manifest import Manifest
from ..format.reading import read_checkpoint
from ..format.refs import check_checkpoint_name, ref_files, split_ref_name
from ..storage import Location, Storage, parse_location, storage_for
from .staging import StagedItem

_xxhash: Any
try:  # a maintained binding, 30x faster than blake2b here; optional
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

UNKNOWN_HASH = bytes(rec.HASH_SIZE)  # a chunk whose hash nobody computed (never matches)
_PARALLEL_BYTES = 8 << 20  # hash in threads above this many bytes


def hash_id() -> int:
    """The hash function this process uses (format.records.HASHES)."""
    return 1 if _xxhash is not None else 2


def chunk_hash(raw: memoryview | bytes, hid: int | None = None) -> bytes:
    """The 128-bit content hash of a chunk's bytes."""
    hid = hash_id() if hid is None else hid
    if hid == 1:
        if _xxhash is None:
            raise SnapshardError("xxh3-128 hashes need the xxhash package")
        return bytes(_xxhash.xxh3_128_digest(raw))
    if hid == 2:
        return hashlib.blake2b(raw, digest_size=rec.HASH_SIZE).digest()
    raise SnapshardError(f"unknown content hash function {hid}")


def checkpoint_parent_and_name(location: Location | Storage) -> tuple[str, str]:
    return parse_location(
        location.url if isinstance(location, Storage) else location
    ).parent_and_name()


@dataclass
class BaseChunk:
    candidate: int  # index into Base.candidates
    flags: int
    offset: int
    nbytes: int
    block: int
    nblocks: int
    crc_offset: int
    hash: bytes


@dataclass
class Base:
    """The base checkpoint of an incremental save, as one process sees it."""

    storage: Storage
    name: str
    manifest: Manifest
    finder: ChunkFinder  # its chunk records (format.reading.read_checkpoint)
    # dicts {"checkpoint", "file", "size"}: what the new checkpoint's refs may name
    candidates: list[dict[str, Any]] = field(default_factory=list)
    _file_to_candidate: dict[int, int] = field(default_factory=dict)
    _by_path: dict[Any, Any] = field(default_factory=dict)
    _file_base: list[int] = field(default_factory=list)  # global number of file 0, per process

    @staticmethod
    def open(base: Location | Storage, target: Storage) -> Base:
        storage = storage_for(base)
        name = check_base_location(storage, target)
        manifest, finder = read_checkpoint(storage)
        if finder is None or manifest.processes is None:
            raise ValueError(f"{storage.url}: the base of an incremental save must be format v2")
        b = Base(storage, name, manifest, finder)
        b._by_path = manifest.leaf_by_path()
        b._file_base = [int(x) for x in manifest.processes.base]
        own = b._file_base[-1]
        for k, r in enumerate(manifest.refs):
            if isinstance(r, dict):
                b._file_to_candidate[own + k] = len(b.candidates)
                b.candidates.append(dict(r))
        for i, f in enumerate(manifest.files[:own]):
            b._file_to_candidate[i] = len(b.candidates)
            b.candidates.append({"checkpoint": name, "file": f.name, "size": f.size})
        return b

    def chunks(
        self, wants: list[tuple[tuple[Any, ...], str, tuple[int, ...], list[Any]]]
    ) -> list[dict[bytes, BaseChunk]]:
        """Per (path, dtype, shape, boxes) asked for: the base's chunks of leaf `path` with
        exactly one of `boxes`, keyed by box_key; empty where the base has no such leaf (or
        another dtype or shape). Each record file is read once for all of them."""
        m = self.manifest
        if not m.bound:  # a 2.0 base's checksums are not bound to its files: write anew
            return [{} for _ in wants]
        found: list[tuple[ArrayLeaf, list[Any]] | None] = []
        for path, dtype, shape, boxes in wants:
            leaf = self._by_path.get(path)
            ok = isinstance(leaf, ArrayLeaf) and leaf.dtype == dtype and tuple(leaf.shape) == shape
            found.append((leaf, boxes) if ok else None)  # type: ignore[arg-type]
        asked = [(leaf, [(np.asarray(s), np.asarray(e)) for s, e in boxes])
                 for leaf, boxes in (f for f in found if f is not None)]  # fmt: skip
        records = self.finder.hashed_records(asked, hash_id())
        return [{} if f is None else self._matching(f[1], records[id(f[0])]) for f in found]

    def _matching(
        self, boxes: list[Any], records: list[tuple[int, rec.Records, np.ndarray | None]]
    ) -> dict[bytes, BaseChunk]:
        """The records with exactly one of `boxes` that a new save may refer to."""
        want = {box_key(s, e) for s, e in boxes}
        out: dict[bytes, BaseChunk] = {}
        for q, r, hashes in records:
            for i in range(len(r)):
                key = r.starts[i].tobytes() + b"|" + r.stops[i].tobytes()
                if key in want and (chunk := self._referable(q, r, i, hashes)) is not None:
                    out[key] = chunk
        return out

    def _referable(
        self, q: int, r: rec.Records, i: int, hashes: np.ndarray | None
    ) -> BaseChunk | None:
        """Record i of process q as a chunk a new save may refer to; None for a malformed
        record or one with flags this version does not know (never referred to)."""
        assert self.manifest.processes is not None
        f = int(r.file[i])
        is_ref = bool(r.flags[i] & rec.FLAG_REFERENCE)
        own = self._file_base[-1]
        g = own + f if is_ref else self._file_base[q] + f
        if (not is_ref and f >= len(self.manifest.processes.data_sizes[q])) or (
            g not in self._file_to_candidate
        ):
            return None
        if int(r.flags[i]) & ~(rec.FLAG_REFERENCE | rec.CODEC_MASK):
            return None
        return BaseChunk(
            self._file_to_candidate[g], int(r.flags[i]) & ~rec.FLAG_REFERENCE,
            int(r.offset[i]), int(r.nbytes[i]), int(r.block[i]),
            -(-int(r.nbytes[i]) // max(int(r.block[i]), 1)), int(r.crc_offset[i]),
            bytes(hashes[i]) if hashes is not None else UNKNOWN_HASH,
        )  # fmt: skip


def check_base_location(base: Location | Storage, target: Storage) -> str:
    """The base's name, after checking that it is another checkpoint beside `target`."""
    parent, name = checkpoint_parent_and_name(base)
    tparent, tname = checkpoint_parent_and_name(target)
    url = base.url if isinstance(base, Storage) else os.fspath(base)
    if parent != tparent:
        raise ValueError(
            f"the base of an incremental save must be another checkpoint beside it: "
            f"{url} is not under {tparent}"
        )
    if name == tname:
        raise ValueError(f"the base of an incremental save is another checkpoint: {url} is itself")
    try:
        return check_checkpoint_name(name, url)
    except CorruptCheckpointError:  # (a reader's error, where a manifest names it)
        raise ValueError(
            f"{url}: the base of an incremental save is named in the new checkpoint's "
            "manifest, so its name has letters, digits, '.', '_' and '-' only, and no '..'"
        ) from None


def box_key(start: Any, stop: Any) -> bytes:
    return np.asarray(start, np.int64).tobytes() + b"|" + np.asarray(stop, np.int64).tobytes()


class UnprovableBaseWarning(UserWarning):
    """An incremental save's base cannot prove its chunks equal to the new ones (no content
    hashes, or an older format): they are written again instead of referred to."""


@dataclass
class Increment:
    """What one process's save needs to record hashes and, given a base, references."""

    base_location: Location | Storage | None
    target: Storage
    identical: frozenset[int] = frozenset()  # leaves that are the base step's very arrays
    hid: int = field(default_factory=hash_id)
    # filled in by split(): content hash per (leaf, box), references, candidates used
    hashes: dict[tuple[int, bytes], bytes] = field(default_factory=dict)
    ref_rows: list[tuple[int, tuple[Any, ...]]] = field(default_factory=list)
    used: set[int] = field(default_factory=set)
    referenced_bytes: int = 0
    _base: Base | None = None
    ref_codecs: set[int] = field(default_factory=set)  # codecs of the chunks referred to
    unhashed_bytes: int = 0  # base chunks of the same boxes without a hash to compare

    def __post_init__(self) -> None:
        if self.base_location is not None:
            check_base_location(self.base_location, self.target)

    @property
    def base(self) -> Base | None:
        """The base, opened on first use (in the background phase, not the blocking one)."""
        if self._base is None and self.base_location is not None:
            self._base = Base.open(self.base_location, self.target)
        return self._base

    def split(
        self, items: list[StagedItem], leaves: list[Any], threads: int = 2
    ) -> list[StagedItem]:
        """Hash every item (unless identical) and decide which are references; returns the
        items still to write. Referenced items are released."""
        lookup = self._base_chunks(items, leaves)
        lock = threading.Lock()

        def run(it: StagedItem) -> StagedItem | None:
            return self._refer_or_keep(it, lookup.get(it.leaf, {}), lock)

        # Items to hash in threads (hashing releases the GIL); the rest cost nothing.
        heavy = [it for it in items if it.leaf not in self.identical]
        if threads > 1 and len(heavy) > 1 and sum(it.nbytes for it in heavy) > _PARALLEL_BYTES:
            from concurrent.futures import ThreadPoolExecutor

            light = [run(it) for it in items if it.leaf in self.identical]
            with ThreadPoolExecutor(min(threads, len(heavy)), "snapshard-hash") as pool:
                kept = light + list(pool.map(run, heavy))
        else:
            kept = [run(it) for it in items]
        self._warn_unprovable(items)
        return [it for it in kept if it is not None]

    def _base_chunks(
        self, items: list[StagedItem], leaves: list[Any]
    ) -> dict[int, dict[bytes, BaseChunk]]:
        """Per leaf of the items: the base's chunks of the items' boxes, by box key."""
        if self.base is None:
            return {}
        by_leaf: dict[int, list[Any]] = {}
        for it in items:
            by_leaf.setdefault(it.leaf, []).append((it.start, it.stop))
        wants = [
            (tuple(leaves[i].path), leaves[i].dtype.name, tuple(leaves[i].shape), boxes)
            for i, boxes in by_leaf.items()
        ]
        return dict(zip(by_leaf, self.base.chunks(wants), strict=True))

    def _refer_or_keep(
        self, it: StagedItem, base: dict[bytes, BaseChunk], lock: threading.Lock
    ) -> StagedItem | None:
        """The item, to write; or None where the base's chunk of its box (in `base`) holds
        the same bytes: a reference row is recorded instead and the item released."""
        key = box_key(it.start, it.stop)
        found = base.get(key)
        if found is not None and found.nbytes != it.nbytes:
            found = None
        same = found is not None and it.leaf in self.identical
        if same:
            assert found is not None
            h = found.hash  # exact without hashing: the base saved this very array
        else:
            data = it.materialize()
            h = chunk_hash(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data, self.hid)
        self.hashes[(it.leaf, key)] = h
        if found is not None and not same and found.hash == UNKNOWN_HASH:
            with lock:
                self.unhashed_bytes += it.nbytes
        if found is None or not (same or (h != UNKNOWN_HASH and h == found.hash)):
            return it
        row = (
            found.candidate, rec.FLAG_REFERENCE | found.flags, found.offset, found.nbytes,
            found.block, found.nblocks, found.crc_offset,
            [int(x) for x in it.start], [int(x) for x in it.stop],
        )  # fmt: skip
        with lock:
            self.ref_rows.append((it.leaf, row))
            self.used.add(found.candidate)
            self.referenced_bytes += it.nbytes
            if found.flags >> rec.CODEC_SHIFT:
                self.ref_codecs.add(found.flags >> rec.CODEC_SHIFT)
        it.release()
        return None

    def _warn_unprovable(self, items: list[StagedItem]) -> None:
        """Say so when the base cannot prove chunks equal, so that they are all written
        again: a save with a base is meant to refer to what did not change."""
        base = self.base
        if base is None:
            return
        if not base.manifest.bound and items:
            why = "it is format 2.0, whose checksums are not bound to their files"
        elif self.unhashed_bytes:
            why = (
                f"it records no {rec.HASHES.get(self.hid, '?')} content hashes for "
                f"{self.unhashed_bytes} bytes of chunks of the same boxes (saved without "
                "SaveOptions(hashes=True), or with another hash function)"
            )
        else:
            return
        warnings.warn(
            f"incremental save onto {base.storage.url}: {why}; those chunks are written "
            "again. Give the base hashes (SaveOptions(hashes=True); CheckpointManager("
            "incremental=True) does) so that later saves refer to it",
            UnprovableBaseWarning,
            stacklevel=2,
        )

    def segment_hashes(self, segments: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Per leaf, the hash of each record in the segment's (sorted) order."""
        out = {}
        for leaf, recs in segments.items():
            table = np.zeros((len(recs), rec.HASH_SIZE), np.uint8)
            for i in range(len(recs)):
                h = self.hashes.get((leaf, box_key(recs["start"][i], recs["stop"][i])))
                table[i] = np.frombuffer(h or UNKNOWN_HASH, np.uint8)
            out[leaf] = table
        return out

    def report(self) -> dict[str, Any]:
        return {
            "refs_used": sorted(self.used),
            "referenced_bytes": self.referenced_bytes,
            "ref_codecs": sorted(self.ref_codecs),
        }


def manifest_refs(base: Base | None, reports: list[dict[str, Any]]) -> list[Any]:
    """The manifest's refs: the base's candidates that some process used, null elsewhere."""
    if base is None:
        return []
    used = {int(i) for r in reports for i in r.get("refs_used", [])}
    refs: list[Any] = [c if i in used else None for i, c in enumerate(base.candidates)]
    while refs and refs[-1] is None:
        refs.pop()
    return refs


def check_refs_committed(storage: Storage, refs: list[Any]) -> list[FileEntry]:
    """Process 0 at commit: every referenced checkpoint is still committed (a reference to
    anything else is never committed); returns the referenced files as manifest entries."""
    files = ref_files(refs, storage.url, bound=True)  # this library writes 2.1
    names = {split_ref_name(f.name)[0] for f in files if f.name}  # type: ignore[index]
    for name in sorted(names):
        if not storage.sibling(name).is_committed():
            raise SnapshardError(
                f"save to {storage.url}: referenced checkpoint {name!r} is no longer committed"
            )
    return files
