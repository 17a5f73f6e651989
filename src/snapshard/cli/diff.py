"""`snapshard diff A B`: leaves added, removed, changed in shape or dtype, and with --values
changed in value (count and max abs difference), read slab by slab with bounded memory.

A and B may be of different formats (an Orbax checkpoint and its conversion, say); leaves
are matched by their path, and against a safetensors file by the name an export gives them
(their path joined with '.', as `convert --to safetensors` writes it).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..dtypes import dtype_from_name
from ..format import ArrayLeaf, Leaf, ValueLeaf
from ..format.kinds import LeafKind
from .ls import open_for_command
from .options import add_listing_options, add_memory_option, name_selector, shown_count
from .output import Output, Progress, json_value
from .reader import CheckpointReader, slabs
from .tables import load_all_tables

# Slabs are sized for the float64 / complex128 copies made to compare them.
_WIDE_ITEMSIZE = 16


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("diff", parents=[common], help="compare two checkpoints")
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--values", action="store_true", help="also compare array values (reads both)")
    add_memory_option(p)
    add_listing_options(p, "differences of each kind")
    p.set_defaults(run=run)


def describe(leaf: Leaf) -> dict[str, Any]:
    if isinstance(leaf, ValueLeaf):
        return {"kind": "value", "value": json_value(leaf.value)}
    dtype = f"key<{leaf.key_impl}>" if leaf.kind == LeafKind.PRNG_KEY else leaf.dtype
    return {"kind": leaf.kind, "shape": list(leaf.logical_shape), "dtype": dtype}


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    return type(x) is type(y) and x == y


def _wide(a: np.ndarray) -> np.ndarray:
    return a.astype(np.complex128 if a.dtype.kind == "c" else np.float64)


def compare_values(p: np.ndarray, q: np.ndarray) -> tuple[int, float]:
    """(elements that differ, max abs difference); NaN equals NaN, -0.0 equals 0.0."""
    if p.dtype == q.dtype and np.array_equal(
        p.reshape(-1).view(np.uint8), q.reshape(-1).view(np.uint8)
    ):
        return 0, 0.0
    if p.dtype == q.dtype and p.dtype.kind in "biu":
        neq = p != q
        x, y = _wide(p[neq]), _wide(q[neq])
    else:
        x, y = _wide(p), _wide(q)
        neq = (x != y) & ~(np.isnan(x) & np.isnan(y))
        x, y = x[neq], y[neq]
    n = int(np.count_nonzero(neq))
    if n == 0:
        return 0, 0.0
    d = np.abs(x - y)
    return n, float(np.inf if np.isnan(d).any() else d.max())


def compare_leaf(
    a: CheckpointReader,
    b: CheckpointReader,
    x: ArrayLeaf,
    y: ArrayLeaf,
    buffer_bytes: int,
    bar: Progress,
) -> dict[str, Any] | None:
    differing, max_abs = 0, 0.0
    zeros = (0,) * len(x.shape)
    for start, stop in slabs(zeros, x.shape, _WIDE_ITEMSIZE, buffer_bytes):
        p = a.read_box(x, start, stop)
        q = b.read_box(y, start, stop)
        n, m = compare_values(p, q)
        differing += n
        max_abs = max(max_abs, m)
        bar.update(p.nbytes)
    return _value_doc(x, differing, max_abs)


def _value_doc(x: ArrayLeaf, differing: int, max_abs: float) -> dict[str, Any] | None:
    if not differing:
        return None
    return {
        "name": x.name,
        "differing": differing,
        "elements": math.prod(x.shape),
        "max_abs_diff": json_value(max_abs),
    }


# Arrays small enough are compared many at a time: one batch of reads from each checkpoint
# per group, not two per array. Bounded in count as verify bounds its batches.
BATCH_ARRAYS = 8192


def compare_small(
    a: CheckpointReader,
    b: CheckpointReader,
    pairs: list[tuple[ArrayLeaf, ArrayLeaf]],
    bar: Progress,
) -> list[dict[str, Any]]:
    """compare_leaf for arrays that fit in the buffer, each read whole, all in one batch."""
    boxes = [((0,) * len(x.shape), x.shape) for x, _ in pairs]
    ps = a.read_boxes([(x, s, e) for (x, _), (s, e) in zip(pairs, boxes, strict=True)])
    qs = b.read_boxes([(y, s, e) for (_, y), (s, e) in zip(pairs, boxes, strict=True)])
    found = []
    for (x, _), p, q in zip(pairs, ps, qs, strict=True):
        d = _value_doc(x, *compare_values(p, q))
        if d is not None:
            found.append(d)
        bar.update(p.nbytes)
    return found


def compare_all(
    a: CheckpointReader,
    b: CheckpointReader,
    pairs: list[tuple[ArrayLeaf, ArrayLeaf]],
    buffer_bytes: int,
    bar: Progress,
) -> list[dict[str, Any]]:
    """The value differences of `pairs` (same shapes), in their order: arrays whose wide
    copies fit in `buffer_bytes` gathered into batches, larger ones slab by slab."""
    found: list[dict[str, Any]] = []
    group: list[tuple[ArrayLeaf, ArrayLeaf]] = []
    held = 0

    def flush() -> None:
        nonlocal group, held
        if group:
            found.extend(compare_small(a, b, group, bar))
        group, held = [], 0

    for x, y in pairs:
        wide = math.prod(x.shape) * _WIDE_ITEMSIZE
        if wide > buffer_bytes:
            flush()
            d = compare_leaf(a, b, x, y, buffer_bytes, bar)
            found.extend([d] if d is not None else [])
            continue
        if held + wide > buffer_bytes or len(group) >= BATCH_ARRAYS:
            flush()
        group.append((x, y))
        held += wide
    flush()
    return found


def _signature(leaf: Leaf) -> tuple[Any, ...]:
    """What `describe` says of an array, as a tuple (no name, no dict: cheap per leaf)."""
    assert isinstance(leaf, ArrayLeaf)
    return (leaf.kind, leaf.logical_shape, leaf.dtype, leaf.key_impl)


def diff(
    a: CheckpointReader,
    b: CheckpointReader,
    values: bool,
    out: Output,
    buffer_bytes: int,
    selects: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    # Matched by path; names are made only for the leaves reported (or chosen by --select).
    exported = "safetensors" in (a.format, b.format)
    la = _by_path(a.manifest.leaves, selects, exported)
    lb = _by_path(b.manifest.leaves, selects, exported)
    changed = []
    to_compare: list[tuple[ArrayLeaf, ArrayLeaf]] = []
    for path, x in la.items():
        y = lb.get(path)
        if y is None:
            continue
        if isinstance(x, ArrayLeaf) and isinstance(y, ArrayLeaf):
            if _signature(x) != _signature(y):
                changed.append({"name": x.name, "a": describe(x), "b": describe(y)})
            if x.shape == y.shape:
                to_compare.append((x, y))
        elif not (
            isinstance(x, ValueLeaf) and isinstance(y, ValueLeaf) and _same_value(x.value, y.value)
        ):
            changed.append({"name": x.name, "a": describe(x), "b": describe(y)})
    doc: dict[str, Any] = {
        "a": a.url,
        "b": b.url,
        "added": [{"name": y.name, **describe(y)} for p, y in lb.items() if p not in la],
        "removed": [{"name": x.name, **describe(x)} for p, x in la.items() if p not in lb],
        "changed": changed,
        "values": None,
    }
    if values:
        for reader in (a, b):
            load_all_tables(reader)
        total = sum(math.prod(x.shape) * dtype_from_name(x.dtype).itemsize for x, _ in to_compare)
        with out.progress(total, "diff") as bar:
            doc["values"] = compare_all(a, b, to_compare, buffer_bytes, bar)
    doc["identical"] = not (doc["added"] or doc["removed"] or changed or doc["values"])
    return doc


def _by_path(
    leaves: list[Leaf], selects: Callable[[str], bool] | None, exported: bool
) -> dict[Any, Leaf]:
    """The leaves by path, or (`exported`) by the name a safetensors export gives them."""
    chosen = leaves if selects is None else [leaf for leaf in leaves if selects(leaf.name)]
    if exported:
        return {".".join(map(str, leaf.path)): leaf for leaf in chosen}
    return {leaf.path: leaf for leaf in chosen}


def _brief(d: dict[str, Any]) -> str:
    if d["kind"] == "value":
        return repr(d["value"])
    return f"{tuple(d['shape'])} {d['dtype']}"


def render(doc: dict[str, Any], shown: int | None = None) -> str:
    """The differences, one a line: the first `shown` of each kind (None: all)."""
    if doc["identical"]:
        return "identical" + (
            "" if doc["values"] is not None else " (shapes and dtypes; --values compares data)"
        )
    lines: list[str] = []

    def listing(
        entries: list[dict[str, Any]], what: str, line: Callable[[dict[str, Any]], str]
    ) -> None:
        lines.extend(line(d) for d in entries[:shown])
        if shown is not None and len(entries) > shown:
            lines.append(
                f"  ... {len(entries) - shown} more {what} (--limit N or --all prints them)"
            )

    listing(doc["added"], "added", lambda d: f"+ {d['name']}: {_brief(d)}")
    listing(doc["removed"], "removed", lambda d: f"- {d['name']}: {_brief(d)}")
    listing(
        doc["changed"], "changed", lambda d: f"~ {d['name']}: {_brief(d['a'])} -> {_brief(d['b'])}"
    )
    listing(
        doc["values"] or [],
        "differing in value",
        lambda d: (
            f"≠ {d['name']}: {d['differing']} of {d['elements']} elements differ, "
            f"max abs difference {d['max_abs_diff']}"
        ),
    )
    return "\n".join(lines)


def run(args: argparse.Namespace, out: Output) -> int:
    buffer_bytes = args.buffer_bytes
    shown = shown_count(args.limit, out.json_mode)
    with open_for_command(args.a, "diff") as a, open_for_command(args.b, "diff") as b:
        doc = diff(a, b, args.values, out, buffer_bytes, name_selector(args.select))
    out.result(doc, lambda: render(doc, shown))
    return 0 if doc["identical"] else 1
