"""Any checkpoint opened for tools: its leaves, and boxes of its arrays read one at a time.

snapshard and Orbax checkpoints are read through the restore path (checksums verified for
snapshard), safetensors files through `snapshard.safetensors.load`. Tools stream large
arrays as slabs: boxes of at most a given number of bytes, each contiguous in C order.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import dtype_from_name
from ..format import ArrayLeaf, Leaf, Manifest
from ..format.naming import MANIFEST_NAME

# The restore path's own request and buffer types: reads here run exactly the code (and the
# checksum verification) of a restore.
from ..options import ReadOptions
from ..planning.layout import Box
from ..reading import Dest, ReadStats, aligned_empty
from ..reading.sources import open_checkpoint
from ..storage import Location, Storage, storage_for
from ..storage.location import local_path

SAFETENSORS_SUFFIX = ".safetensors"


@dataclass
class CheckpointReader:
    """A checkpoint's manifest (its tree and leaves) and reads of boxes of its arrays."""

    url: str
    format: str  # "snapshard", "orbax" or "safetensors"
    manifest: Manifest
    _read: Callable[[list[Dest]], None]
    storage: Storage | None = None  # what to close when done
    stats: ReadStats = field(default_factory=ReadStats)

    def read_box(self, leaf: ArrayLeaf, start: Any, stop: Any) -> np.ndarray:
        """Box [start, stop) of a saved array, in its saved dtype (key data for PRNG keys)."""
        return self.read_boxes([(leaf, start, stop)])[0]

    def read_boxes(self, boxes: Sequence[tuple[ArrayLeaf, Any, Any]]) -> list[np.ndarray]:
        """Many boxes (of one or many arrays) in one batch of reads: what `read_box` gives
        for each, without a batch per box (tools walking many small arrays)."""
        out: list[np.ndarray | Dest] = []
        # Boxes alike share their arrays: the read planner answers them once (it caches its
        # coverage checks by the box arrays' identity), not once per array.
        alike: dict[tuple[Any, Any], tuple[np.ndarray, np.ndarray]] = {}
        for leaf, start, stop in boxes:
            dtype = dtype_from_name(leaf.dtype)
            key = (tuple(start), tuple(stop))
            shared = alike.get(key)
            if shared is None:
                shared = alike[key] = (np.asarray(start, np.int64), np.asarray(stop, np.int64))
            s, e = shared
            shape = tuple(int(x) for x in e - s)
            if math.prod(shape) == 0:
                out.append(np.empty(shape, dtype))
            else:
                out.append(Dest(leaf, s, e, aligned_empty(math.prod(shape) * dtype.itemsize)))
        dests = [d for d in out if isinstance(d, Dest)]
        if dests:
            self._read(dests)
        # Views taken after the reads: a source may hand over buffers of its own (Orbax's).
        return [d if isinstance(d, np.ndarray) else _view(d) for d in out]

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _view(d: Dest) -> np.ndarray:
    return d.buf.view(dtype_from_name(d.leaf.dtype)).reshape(d.shape)


def is_safetensors(location: Location) -> bool:
    """A `.safetensors` name or index (`….safetensors.index.json`), a local directory of
    safetensors files with no manifest (what `convert --to safetensors` writes), or a local
    file that starts like one (a header length, then '{')."""
    text = os.fspath(location)
    if text.endswith((SAFETENSORS_SUFFIX, SAFETENSORS_SUFFIX + ".index.json")):
        return True
    path = local_path(text)
    if path is not None and os.path.isdir(path):
        names = os.listdir(path)
        return MANIFEST_NAME not in names and any(n.endswith(SAFETENSORS_SUFFIX) for n in names)
    if path is None or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") > 1


def open_reader(location: Location, options: ReadOptions = ReadOptions()) -> CheckpointReader:
    """Open the checkpoint at `location`: snapshard, Orbax or a safetensors file."""
    if is_safetensors(location):
        return _safetensors_reader(os.fspath(location))
    storage = storage_for(location)
    stats = ReadStats()
    try:
        source, read_dests = open_checkpoint(storage, options, stats)
    except BaseException:
        storage.close()
        raise
    manifest = source.manifest
    fmt = str(manifest.extra.get("format", "snapshard"))
    return CheckpointReader(storage.url, fmt, manifest, read_dests, storage, stats)


def _safetensors_reader(location: str) -> CheckpointReader:
    """Safetensors files seen as a checkpoint of one chunk per tensor, read by byte ranges
    (safetensors.source); the manifest holds their tree, a dict by tensor name."""
    from ..safetensors.files import open_files
    from ..safetensors.loader import source_arrays
    from ..safetensors.source import SafetensorsSource
    from ..transforms.virtual import leaf_of

    files, weight_map = open_files(location)
    try:
        tensors = source_arrays(files, weight_map)
        leaves: list[Leaf] = [leaf_of(name, x) for name, x in tensors.items()]
    except BaseException:
        files.close()
        raise
    names = list(tensors)
    structure = {"t": "dict", "k": names, "c": [{"t": "leaf", "i": i} for i in range(len(names))]}
    source = SafetensorsSource(files, ReadOptions(verify=False))
    manifest = Manifest(structure, leaves, source.entries, extra={"format": "safetensors"})
    stats = ReadStats()
    owned = files.storage if files.owns_storage else None
    return CheckpointReader(
        location, "safetensors", manifest, lambda d: source.read_dests(d, stats), owned, stats
    )


def slabs(start: Any, stop: Any, itemsize: int, max_bytes: int) -> Iterator[Box]:
    """Box [start, stop) cut into boxes of at most `max_bytes` (at least one element each),
    each contiguous in the box's C order: whole trailing axes, a run of one axis, and one
    index of every leading axis."""
    s0 = np.asarray(start, np.int64)
    e0 = np.asarray(stop, np.int64)
    ext = e0 - s0
    nd = len(ext)
    if np.any(ext <= 0) and nd:
        return
    if nd == 0 or math.prod(int(x) for x in ext) * itemsize <= max_bytes:
        yield tuple(s0.tolist()), tuple(e0.tolist())
        return
    # Absorb trailing axes while they fit; split axis k into runs of `step` rows.
    inner, k = itemsize, nd - 1
    while k > 0 and inner * int(ext[k]) <= max_bytes:
        inner *= int(ext[k])
        k -= 1
    step = max(1, max_bytes // inner)
    for lead in np.ndindex(*(int(x) for x in ext[:k])):
        for a in range(0, int(ext[k]), step):
            s, e = s0.copy(), e0.copy()
            s[:k] = s0[:k] + np.asarray(lead, np.int64)
            e[:k] = s[:k] + 1
            s[k] = s0[k] + a
            e[k] = min(s0[k] + a + step, e0[k])
            yield tuple(s.tolist()), tuple(e.tolist())


def chunk_slabs(leaf: ArrayLeaf, max_bytes: int) -> Iterator[tuple[int, Box]]:
    """Every chunk of a leaf as slabs of at most `max_bytes`: (chunk number, box)."""
    itemsize = dtype_from_name(leaf.dtype).itemsize
    t = leaf.chunks
    for c in range(len(t)):
        for box in slabs(t.starts[c], t.stops[c], itemsize, max_bytes):
            yield c, box
