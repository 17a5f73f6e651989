"""`snapshard diff A B`: leaves added, removed, changed in shape or dtype, and with --values
changed in value (count and max abs difference), read slab by slab with bounded memory.

A and B may be of different formats (an Orbax checkpoint and its conversion, say); leaves
are matched by their path.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from ..dtypes import dtype_from_name
from ..format import ArrayLeaf, Leaf, ValueLeaf
from ..format.kinds import LeafKind
from ..interop.reader import CheckpointReader, slabs
from .ls import open_for_command
from .options import add_memory_option
from .output import Output, Progress, json_value

# Slabs are sized for the float64 / complex128 copies made to compare them.
_WIDE_ITEMSIZE = 16


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("diff", parents=[common], help="compare two checkpoints")
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p.add_argument("--values", action="store_true", help="also compare array values (reads both)")
    add_memory_option(p)
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
    if not differing:
        return None
    return {
        "name": x.name,
        "differing": differing,
        "elements": math.prod(x.shape),
        "max_abs_diff": json_value(max_abs),
    }


def diff(
    a: CheckpointReader, b: CheckpointReader, values: bool, out: Output, buffer_bytes: int
) -> dict[str, Any]:
    la = {leaf.name: leaf for leaf in a.manifest.leaves}
    lb = {leaf.name: leaf for leaf in b.manifest.leaves}
    common = [n for n in la if n in lb]
    changed = []
    to_compare: list[tuple[ArrayLeaf, ArrayLeaf]] = []
    for name in common:
        x, y = la[name], lb[name]
        if isinstance(x, ArrayLeaf) and isinstance(y, ArrayLeaf):
            if describe(x) != describe(y):
                changed.append({"name": name, "a": describe(x), "b": describe(y)})
            if x.shape == y.shape:
                to_compare.append((x, y))
        elif not (
            isinstance(x, ValueLeaf) and isinstance(y, ValueLeaf) and _same_value(x.value, y.value)
        ):
            changed.append({"name": name, "a": describe(x), "b": describe(y)})
    doc: dict[str, Any] = {
        "a": a.url,
        "b": b.url,
        "added": [{"name": n, **describe(lb[n])} for n in lb if n not in la],
        "removed": [{"name": n, **describe(la[n])} for n in la if n not in lb],
        "changed": changed,
        "values": None,
    }
    if values:
        doc["values"] = []
        total = sum(math.prod(x.shape) * dtype_from_name(x.dtype).itemsize for x, _ in to_compare)
        with out.progress(total, "diff") as bar:
            for x, y in to_compare:
                d = compare_leaf(a, b, x, y, buffer_bytes, bar)
                if d is not None:
                    doc["values"].append(d)
    doc["identical"] = not (doc["added"] or doc["removed"] or changed or doc["values"])
    return doc


def _brief(d: dict[str, Any]) -> str:
    if d["kind"] == "value":
        return repr(d["value"])
    return f"{tuple(d['shape'])} {d['dtype']}"


def render(doc: dict[str, Any]) -> str:
    if doc["identical"]:
        return "identical" + (
            "" if doc["values"] is not None else " (shapes and dtypes; --values compares data)"
        )
    lines = [f"+ {d['name']}: {_brief(d)}" for d in doc["added"]]
    lines += [f"- {d['name']}: {_brief(d)}" for d in doc["removed"]]
    lines += [f"~ {d['name']}: {_brief(d['a'])} -> {_brief(d['b'])}" for d in doc["changed"]]
    lines += [
        f"≠ {d['name']}: {d['differing']} of {d['elements']} elements differ, "
        f"max abs difference {d['max_abs_diff']}"
        for d in doc["values"] or []
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace, out: Output) -> int:
    buffer_bytes = args.buffer_bytes
    with open_for_command(args.a, "diff") as a, open_for_command(args.b, "diff") as b:
        doc = diff(a, b, args.values, out, buffer_bytes)
    out.result(doc, lambda: render(doc))
    return 0 if doc["identical"] else 1
