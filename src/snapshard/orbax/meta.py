"""The JSON side of an Orbax checkpoint: its tree, shardings and strings, as snapshard data.

An Orbax PyTree item directory holds `_METADATA` (one entry per leaf: the key path, with
each key marked as a dict key or a sequence index, and the value type), `_sharding`
(base64 parameter name -> JSON sharding), `_strings.json` (string leaves) and
`array_metadatas/process_<n>` (per-array extras such as the PRNG key implementation). The
array data sits in one zarr array per leaf, named by the leaf's keys joined with '.'.
Pure functions, no TensorStore.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError
from ..tree import JsonNode, Path, PathKey, path_str

TREE_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
SHARDING = "_sharding"
STRINGS = "_strings.json"
ARRAY_METADATAS = "array_metadatas"

ARRAY_TYPES = ("jax.Array", "np.ndarray")
SCALAR_TYPE = "scalar"
STRING_TYPE = "string"
# Empty values are stored as a type name only: they become empty containers or None.
EMPTY_TYPES = {"Dict": "dict", "List": "list", "Tuple": "tuple", "NamedTuple": "dict"}
NONE_TYPE = "None"
_SEQUENCE_KEY = 1
_DICT_KEY = 2


@dataclass(frozen=True)
class OrbaxEntry:
    """One leaf of an Orbax tree: where it is, the zarr array that holds it, and its type."""

    path: Path
    param: str
    value_type: str

    @property
    def name(self) -> str:
        return path_str(self.path)


@dataclass
class _Node:
    kind: str | None = None  # "dict", "list", "tuple"; None until a key or type says
    children: dict[PathKey, _Node | OrbaxEntry] = field(default_factory=dict)


def load_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})") from None


def parse_tree_metadata(doc: Any, where: str) -> tuple[JsonNode, list[OrbaxEntry]]:
    """The tree structure (snapshard's JSON node form) and its leaves in structure order."""
    tree = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(tree, dict):
        raise CorruptCheckpointError(
            f"{where}: {TREE_METADATA} has no 'tree_metadata' (not an Orbax PyTree checkpoint "
            "this library can read)"
        )
    root = _Node()
    root_leaf: OrbaxEntry | None = None
    for item in tree.values():
        try:
            keys = item["key_metadata"]
            value_type = str(item["value_metadata"]["value_type"])
            path: tuple[PathKey, ...] = tuple(
                int(k["key"]) if k["key_type"] == _SEQUENCE_KEY else str(k["key"]) for k in keys
            )
            kinds = ["list" if k["key_type"] == _SEQUENCE_KEY else "dict" for k in keys]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{where}: malformed {TREE_METADATA} entry ({e})"
            ) from None
        entry = OrbaxEntry(path, ".".join(str(k) for k in path), value_type)
        if not path:
            root_leaf = entry
            continue
        node = root
        for depth, (key, kind) in enumerate(zip(path, kinds, strict=True)):
            if node.kind not in (None, kind):
                raise CorruptCheckpointError(
                    f"{where}: {path_str(path[:depth])!r} is both a dict and a sequence"
                )
            node.kind = kind
            if depth == len(path) - 1:
                if key in node.children:
                    raise CorruptCheckpointError(
                        f"{where}: {path_str(path)!r} is both a leaf and a subtree"
                    )
                if value_type in EMPTY_TYPES:
                    node.children[key] = _Node(EMPTY_TYPES[value_type])
                else:
                    node.children[key] = entry
            else:
                child = node.children.setdefault(key, _Node())
                if isinstance(child, OrbaxEntry):
                    raise CorruptCheckpointError(
                        f"{where}: {path_str(path[: depth + 1])!r} is both a leaf and a subtree"
                    )
                node = child
    entries: list[OrbaxEntry] = []
    if root_leaf is not None:
        if root.children:
            raise CorruptCheckpointError(f"{where}: the root is both a leaf and a tree")
        entries.append(root_leaf)
        return {"t": "leaf", "i": 0}, entries
    return _to_json(root, entries, where), entries


def _to_json(node: _Node | OrbaxEntry, entries: list[OrbaxEntry], where: str) -> JsonNode:
    if isinstance(node, OrbaxEntry):
        entries.append(node)
        return {"t": "leaf", "i": len(entries) - 1}
    if node.kind in ("list", "tuple"):
        keys = sorted(node.children, key=int)
        if keys != list(range(len(keys))):
            raise CorruptCheckpointError(f"{where}: sequence with indices {keys} has gaps")
        return {"t": node.kind, "c": [_to_json(node.children[k], entries, where) for k in keys]}
    keys = list(node.children)
    return {"t": "dict", "k": keys, "c": [_to_json(node.children[k], entries, where) for k in keys]}


def describe_sharding(text: str) -> dict[str, Any] | None:
    """An Orbax sharding record in the form snapshard's manifest uses for saved shardings."""
    try:
        d = json.loads(text)
        kind = str(d["sharding_type"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return None
    if kind == "NamedSharding" and isinstance(d.get("shape"), list):
        names = [str(n) for n in d.get("axis_names", [])]
        shape = [int(s) for s in d["shape"]]
        return {
            "type": kind,
            "mesh": dict(zip(names, shape, strict=False)),
            "spec": d.get("partition_spec", []),
            "num_devices": math.prod(shape),
        }
    if kind == "SingleDeviceSharding":
        return {"type": kind, "num_devices": 1}
    return {"type": kind}


def parse_shardings(data: bytes, where: str) -> dict[str, dict[str, Any]]:
    """Parameter name -> sharding description, from a `_sharding` file."""
    doc = load_json(data, where)
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(doc, dict):
        return out
    for key, text in doc.items():
        try:
            name = base64.urlsafe_b64decode(key).decode()
        except (ValueError, UnicodeDecodeError):
            continue
        desc = describe_sharding(text) if isinstance(text, str) else None
        if desc is not None:
            out[name] = desc
    return out


def parse_key_impls(data: bytes, where: str) -> dict[str, str]:
    """Parameter name -> PRNG key implementation, from one `array_metadatas/process_<n>` file."""
    doc = load_json(data, where)
    out: dict[str, str] = {}
    for item in doc.get("array_metadatas", []) if isinstance(doc, dict) else []:
        meta = item.get("array_metadata", {}) if isinstance(item, dict) else {}
        ext = meta.get("ext_metadata") or {}
        if isinstance(ext, dict) and ext.get("random_key_impl"):
            out[str(meta.get("param_name"))] = str(ext["random_key_impl"])
    return out


def step_item_names(doc: Any) -> list[str] | None:
    """The item names of a CheckpointManager step, from its `_CHECKPOINT_METADATA`."""
    handlers = doc.get("item_handlers") if isinstance(doc, dict) else None
    return sorted(str(k) for k in handlers) if isinstance(handlers, dict) else None


def commit_time(doc: Any) -> float | None:
    """Seconds since the epoch at which a checkpoint was committed, if recorded."""
    if not isinstance(doc, dict):
        return None
    ns = doc.get("commit_timestamp_nsecs")
    return ns / 1e9 if isinstance(ns, int | float) else None


def step_order(name: str) -> list[Any]:
    """Natural order of checkpoint names: '9' before '10', 'step_9' before 'step_10'."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]
