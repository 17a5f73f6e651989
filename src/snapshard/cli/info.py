"""`snapshard info PATH`: what a checkpoint holds, leaf by leaf (no array data is read)."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..format import ArrayLeaf, Leaf, Manifest
from ..format.kinds import LeafKind
from ..format.leaves import PerProcessLeaf
from .ls import open_for_command
from .options import add_listing_options, name_selector, shown_count
from .output import (
    Output,
    describe_sharding,
    format_metrics,
    human_bytes,
    iso_time,
    json_value,
    table,
)
from .reader import CheckpointReader


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "info", parents=[common], help="leaves of a checkpoint: shape, dtype, bytes, sharding"
    )
    p.add_argument("path", help="a snapshard or Orbax checkpoint, or safetensors")
    add_listing_options(p, "leaves")
    p.set_defaults(run=run)


def leaf_doc(leaf: Leaf) -> dict[str, Any]:
    base: dict[str, Any] = {"name": leaf.name, "path": list(leaf.path)}
    if isinstance(leaf, PerProcessLeaf):  # its values are in each process's own file
        return {**base, "kind": "per_process"}
    if not isinstance(leaf, ArrayLeaf):
        return {**base, "kind": "value", "value": json_value(leaf.value)}
    return {
        **base,
        "kind": leaf.kind,
        "shape": list(leaf.logical_shape),
        "dtype": f"key<{leaf.key_impl}>" if leaf.kind == LeafKind.PRNG_KEY else leaf.dtype,
        "bytes": leaf.nbytes,
        "sharding": leaf.sharding,
        "chunks": leaf.num_chunks,
    }


def checkpoint_doc(
    reader: CheckpointReader,
    shown: int | None = None,
    selects: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """What `info` says of a checkpoint: its header, a summary of every leaf, and the
    first `shown` leaves (None: all) of those `selects` chooses by name (None: every one)."""
    m: Manifest = reader.manifest
    leaves: list[Leaf] = m.leaves
    if selects is not None:
        leaves = [leaf for leaf in leaves if selects(leaf.name)]
    listed = leaves if shown is None else leaves[:shown]
    doc: dict[str, Any] = {
        "path": reader.url,
        "format": reader.format,
        "created_unix": m.created_unix or None,
        "created": iso_time(m.created_unix),
        "process_count": m.process_count,
        "bytes": sum(a.nbytes for a in m.arrays),
        "files": len(m.files),
        "leaf_count": len(m.leaves),
        "summary": summary(m.leaves),
        "selected": len(leaves),
        "leaves": [leaf_doc(leaf) for leaf in listed],
    }
    if reader.format == "snapshard":
        doc.update(version=m.version_text, write_mode=m.write_mode)  # "2.1": as the manifest says
        if "step" in m.extra:
            doc["step"] = m.extra["step"]
        if reader.storage is not None and reader.storage.is_retained():
            doc["retained"] = True  # its files kept for later steps' references: no step
        if m.extra.get("metrics") is not None:
            doc["metrics"] = m.extra["metrics"]
    elif "layout" in m.extra:
        doc["layout"] = m.extra["layout"]
    return doc


def summary(leaves: list[Leaf]) -> dict[str, Any]:
    """Leaves counted by kind, and the arrays' count and bytes by dtype (largest first)."""
    kinds: Counter[str] = Counter()
    count: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for leaf in leaves:
        if isinstance(leaf, PerProcessLeaf):
            kinds["per_process"] += 1
        elif not isinstance(leaf, ArrayLeaf):
            kinds["value"] += 1
        else:
            kinds[str(leaf.kind)] += 1
            dtype = f"key<{leaf.key_impl}>" if leaf.kind == LeafKind.PRNG_KEY else leaf.dtype
            count[dtype] += 1
            nbytes[dtype] += leaf.nbytes
    dtypes = {
        d: {"arrays": count[d], "bytes": nbytes[d]}
        for d in sorted(count, key=lambda d: (-nbytes[d], d))
    }
    return {"kinds": dict(kinds), "dtypes": dtypes}


def _summary_line(doc: dict[str, Any]) -> str:
    kinds = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in doc["summary"]["kinds"].items())
    dtypes = ", ".join(
        f"{d} {v['arrays']} ({human_bytes(v['bytes'])})"
        for d, v in doc["summary"]["dtypes"].items()
    )
    return f"leaves: {kinds or 'none'}" + (f"; arrays by dtype: {dtypes}" if dtypes else "")


def render(doc: dict[str, Any]) -> str:
    head = [doc["format"] + (f" v{doc['version']}" if "version" in doc else "")]
    if doc.get("layout"):
        head.append(str(doc["layout"]))
    head.append(f"{doc['process_count']} process(es)")
    if doc.get("created"):
        head.append(f"created {doc['created']}")
    head.append(f"{human_bytes(doc['bytes'])} in {doc['leaf_count']} leaves")
    if doc.get("step") is not None:
        head.append(f"step {doc['step']}")
    if doc.get("retained"):
        head.append("retained for later steps' references, not restorable")
    if doc.get("metrics"):
        head.append(f"metrics {format_metrics(doc['metrics'])}")
    rows = []
    for leaf in doc["leaves"]:
        if leaf["kind"] == "value":
            rows.append([leaf["name"], "value", repr(leaf["value"]), "", "", "", ""])
        elif leaf["kind"] == "per_process":
            rows.append([leaf["name"], "per process", "", "", "", "", "one value per process"])
        else:
            rows.append(
                [
                    leaf["name"],
                    leaf["kind"],
                    str(tuple(leaf["shape"])),
                    leaf["dtype"],
                    human_bytes(leaf["bytes"]),
                    str(leaf["chunks"]),
                    describe_sharding(leaf["sharding"]),
                ]
            )
    header = ["LEAF", "KIND", "SHAPE", "DTYPE", "BYTES", "CHUNKS", "SAVED SHARDING"]
    lines = [f"{doc['path']}: {', '.join(head)}", _summary_line(doc)]
    if rows:
        lines.append(table(header, rows))
    if doc["selected"] != doc["leaf_count"]:
        lines.append(f"{doc['selected']} of {doc['leaf_count']} leaves match --select")
    more = doc["selected"] - len(rows)
    if more:
        lines.append(f"... {more} more leaves (--limit N or --all prints them)")
    return "\n".join(lines)


def run(args: argparse.Namespace, out: Output) -> int:
    shown = shown_count(args.limit, out.json_mode)
    with open_for_command(args.path, "info") as reader:
        doc = checkpoint_doc(reader, shown, name_selector(args.select))
    out.result(doc, lambda: render(doc))
    return 0
