"""Load safetensors files onto a mesh (or into NumPy), through optional lazy transforms."""

from __future__ import annotations

import difflib
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, TargetMismatchError, UnsupportedLeafError
from ..gc_pause import collection_paused
from ..jax.read_once import execute as read_once_execute
from ..options import ReadOptions, require
from ..reading import ReadStats, Request, make_request
from ..reading.restore import is_target_leaf
from ..storage import Location, Storage
from ..transforms.surgery import Transform
from ..transforms.virtual import Stored, Unreadable, VArray
from ..tree import Path, flatten_target
from .dtypes import DTYPES, numpy_dtype
from .files import FileSet, open_files
from .materialize import Planner
from .source import SafetensorsSource


def source_arrays(files: FileSet, weight_map: Mapping[str, str] | None) -> dict[str, VArray]:
    """Every tensor of the files as a lazy array, checked against the index's weight map."""
    out: dict[str, VArray] = {}
    where_of: dict[str, str] = {}
    for i, (name, h) in enumerate(zip(files.names, files.headers, strict=True)):
        for t in h.tensors.values():
            if t.name in out:
                raise CorruptCheckpointError(
                    f"tensor {t.name!r} is in both {where_of[t.name]!r} and {h.file!r}"
                )
            where_of[t.name] = h.file
            if DTYPES[t.dtype][1] is None:
                msg = f"{h.file}, tensor {t.name!r}: dtype {t.dtype} is bit-packed; snapshard reads only byte-addressable dtypes"
                out[t.name] = Unreadable(t.shape, np.dtype(np.uint8), msg)
            else:
                dt = numpy_dtype(t.dtype, h.file)
                out[t.name] = Stored(t.shape, dt, t.name, i, t.begin)
        if weight_map is not None:
            for tensor, file in weight_map.items():
                if file == name and tensor not in h.tensors:
                    raise CorruptCheckpointError(
                        f"the index says tensor {tensor!r} is in {h.file!r}, which does not hold it"
                    )
    return out


def tensor_name(path: Path) -> str:
    """The tensor name of a target leaf: its path keys joined with '.' (HF's convention)."""
    return ".".join(str(k) for k in path)


def _missing(name: str, arrays: Mapping[str, VArray], where: str) -> TargetMismatchError:
    near = difflib.get_close_matches(name, list(arrays), n=3)
    return TargetMismatchError(
        f"{where}: the target asks for tensor {name!r}, which is not there"
        + (f" (similar: {', '.join(near)})" if near else f" ({len(arrays)} tensors)")
    )


def arrays(location: Location | Storage, transform: Transform | None = None) -> dict[str, VArray]:
    """The lazy arrays of a location after `transform`: names, shapes and dtypes; no data read."""
    files, weight_map = open_files(location)
    try:
        src = source_arrays(files, weight_map)
    finally:
        files.close()
    return dict(transform(src)) if transform else src


@collection_paused()
def load(
    location: Location | Storage,
    target: Any = None,
    options: ReadOptions = ReadOptions(),
    *,
    transform: Transform | None = None,
    stats: ReadStats | None = None,
) -> Any:
    """Load safetensors tensors: a file, a directory, or a `model.safetensors.index.json`.

    target=None: every tensor (after `transform`) as a NumPy array, in a dict by name.
    Otherwise a pytree whose leaves name tensors by their path joined with '.', and say what
    to build (as in snapshard.load): a ShapeDtypeStruct with a sharding gives a jax.Array on
    it, read by each process for its own shards only; an np.ndarray or a ShapeDtypeStruct
    without sharding gives NumPy. A differing dtype is cast on the host. `options` as in
    snapshard.load, but for `verify`: safetensors files carry no checksums. With read-once
    on, tensors replicated across processes are read once across the job and sent to the
    other holders, and tensors whose target cuts their rows (columns split over processes)
    are read as bands of whole rows and exchanged.
    """
    require(options, ReadOptions)
    t_start = time.perf_counter()
    stats = stats if stats is not None else ReadStats()
    files, weight_map = open_files(location)
    try:
        source = SafetensorsSource(files, options)
        src = source_arrays(files, weight_map)
        lazy = dict(transform(src)) if transform else src
        if target is None:
            names, targets, matched = list(lazy), [None] * len(lazy), None
        else:
            matched = flatten_target(target, is_target_leaf)
            names, targets = [tensor_name(p) for p in matched.paths], matched.leaves
        planner = Planner()
        reqs = [
            _request(planner, lazy, n, t, source.url) for n, t in zip(names, targets, strict=True)
        ]
        built = read_once_execute(
            reqs, source, options, stats, location=source.url, expand=planner.expand
        )
    finally:
        files.close()
    stats.total_s = time.perf_counter() - t_start
    if matched is None:
        return dict(zip(names, built, strict=True))
    return matched.rebuild(dict(zip(matched.paths, built, strict=True)))


def _request(
    planner: Planner, lazy: Mapping[str, VArray], name: str, target: Any, url: str
) -> Request:
    """The read request of tensor `name` (after the transform) for its target leaf."""
    if name not in lazy:
        raise _missing(name, lazy, url)
    x = lazy[name]
    if isinstance(x, Unreadable):
        raise UnsupportedLeafError(x.error)
    return make_request(planner.leaf(name, x), target, url)
