"""`snapshard info PATH`: what a checkpoint holds, leaf by leaf (no array data is read)."""

from __future__ import annotations

import argparse
from typing import Any

from ..format import ArrayLeaf, Leaf, Manifest
from ..format.kinds import LeafKind
from ..format.manifest import PerProcessLeaf
from ..interop.reader import CheckpointReader
from .ls import open_for_command
from .output import (
    Output,
    describe_sharding,
    format_metrics,
    human_bytes,
    iso_time,
    json_value,
    table,
)


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "info", parents=[common], help="leaves of a checkpoint: shape, dtype, bytes, sharding"
    )
    p.add_argument("path", help="a snapshard or Orbax checkpoint, or a safetensors file")
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


def checkpoint_doc(reader: CheckpointReader) -> dict[str, Any]:
    m: Manifest = reader.manifest
    doc: dict[str, Any] = {
        "path": reader.url,
        "format": reader.format,
        "created_unix": m.created_unix or None,
        "created": iso_time(m.created_unix),
        "process_count": m.process_count,
        "bytes": sum(a.nbytes for a in m.arrays),
        "files": len(m.files),
        "leaves": [leaf_doc(leaf) for leaf in m.leaves],
    }
    if reader.format == "snapshard":
        doc.update(version=m.version_text, write_mode=m.write_mode)  # "2.1": as the manifest says
        if "step" in m.extra:
            doc["step"] = m.extra["step"]
        if m.extra.get("metrics") is not None:
            doc["metrics"] = m.extra["metrics"]
    elif "layout" in m.extra:
        doc["layout"] = m.extra["layout"]
    return doc


def render(doc: dict[str, Any]) -> str:
    head = [doc["format"] + (f" v{doc['version']}" if "version" in doc else "")]
    if doc.get("layout"):
        head.append(str(doc["layout"]))
    head.append(f"{doc['process_count']} process(es)")
    if doc.get("created"):
        head.append(f"created {doc['created']}")
    head.append(f"{human_bytes(doc['bytes'])} in {len(doc['leaves'])} leaves")
    if doc.get("step") is not None:
        head.append(f"step {doc['step']}")
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
    return f"{doc['path']}: {', '.join(head)}\n" + table(header, rows)


def run(args: argparse.Namespace, out: Output) -> int:
    with open_for_command(args.path, "info") as reader:
        doc = checkpoint_doc(reader)
    out.result(doc, lambda: render(doc))
    return 0
