"""Pytree structure: flatten a tree into (path, leaf) pairs and store its shape as JSON.

No pickle: the structure is a small JSON document of nodes. A path is the list of keys from
the root to a leaf: dict keys (str or int), sequence indices (int), attribute names (str).
The same path rules apply to a restore target, so leaves are matched by path.

Without a target, a tree is rebuilt from plain Python containers: dicts, lists and tuples as
saved; a namedtuple or any other registered pytree node becomes a dict of its children keyed
by field or key (the class itself is not imported back: that would need pickle-like trust);
`warn_lost_classes` tells the caller so, naming the first such node and how to pass a target.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .errors import CorruptCheckpointError, UnsupportedLeafError

PathKey = str | int
Path = tuple[PathKey, ...]
JsonNode = dict[str, Any]


def path_str(path: Path) -> str:
    """The display form of a path: keys joined by '/' ('' for the root)."""
    return "/".join(str(k) for k in path)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _dict_key(k: Any, where: Path) -> PathKey:
    if isinstance(k, bool) or not isinstance(k, str | int):
        raise UnsupportedLeafError(
            f"at {path_str(where)!r}: dict key {k!r} is not a str or int and cannot be stored"
        )
    return k


def _key_component(key: Any, where: Path) -> PathKey:
    import jax  # here, not at the top: the format and planning modules import this one

    if isinstance(key, jax.tree_util.DictKey):
        return _dict_key(key.key, where)
    if isinstance(key, jax.tree_util.SequenceKey):
        return int(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return str(key.name)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return int(key.key)
    raise UnsupportedLeafError(f"at {path_str(where)!r}: unsupported pytree key {key!r}")


def keypath_to_path(keypath: tuple[Any, ...]) -> Path:
    """A JAX key path as a snapshard path."""
    out: list[PathKey] = []
    for key in keypath:
        out.append(_key_component(key, tuple(out)))
    return tuple(out)


@dataclass(frozen=True)
class FlatTree:
    """A tree taken apart: its JSON structure and its leaves in structure order."""

    structure: JsonNode
    paths: list[Path]
    leaves: list[Any]


def flatten(tree: Any, is_leaf: Callable[[Any], bool]) -> FlatTree:
    """Walk `tree`; `is_leaf` says which values are leaves (None is always a value leaf)."""
    # A module-level walk, not a recursive closure: a closure refers to itself, and that
    # cycle would keep the tree's leaves alive until a full collection, which the saves'
    # collection pauses (gc_pause.py) may put off for as long as the program runs.
    paths: list[Path] = []
    leaves: list[Any] = []
    return FlatTree(_walk(tree, (), (is_leaf, paths, leaves)), paths, leaves)


_Walk = tuple[Callable[[Any], bool], list[Path], list[Any]]  # is_leaf, paths, leaves


def _walk(node: Any, path: Path, flat: _Walk) -> JsonNode:
    """The structure of `node` at `path`; its leaves and their paths appended to `flat`."""
    if node is None or flat[0](node):
        flat[1].append(path)
        flat[2].append(node)
        return {"t": "leaf", "i": len(flat[2]) - 1}
    if type(node) is dict:
        keys = list(node.keys())
        for k in keys:
            _dict_key(k, path)
        return {
            "t": "dict",
            "k": keys,
            "c": [_walk(node[k], (*path, k), flat) for k in keys],
        }
    if type(node) is list:
        return {"t": "list", "c": [_walk(v, (*path, i), flat) for i, v in enumerate(node)]}
    if type(node) is tuple:
        return {
            "t": "tuple",
            "c": [_walk(v, (*path, i), flat) for i, v in enumerate(node)],
        }
    if _is_namedtuple(node):
        fields = list(type(node)._fields)
        return {
            "t": "namedtuple",
            "name": type(node).__qualname__,
            "k": fields,
            "c": [_walk(getattr(node, f), (*path, f), flat) for f in fields],
        }
    kind = f"{type(node).__module__}.{type(node).__qualname__}"
    try:
        children = _one_level(node, path)
    except ValueError:
        hint = (
            " here: torch state is saved with snapshard.torch (save, load, CheckpointManager)"
            if kind.startswith("torch.")
            else ""
        )
        raise UnsupportedLeafError(
            f"leaf {path_str(path)!r}: values of type {kind} cannot be saved{hint}"
        ) from None
    return {
        "t": "node",
        "name": kind,
        "k": [k for k, _ in children],
        "c": [_walk(child, (*path, k), flat) for k, child in children],
    }


def dict_subclass_children(node: Any, where: Path) -> list[tuple[PathKey, Any]] | None:
    """(key, child) pairs of an OrderedDict (insertion order) or a defaultdict (sorted keys),
    the order JAX gives them; None for other values."""
    if isinstance(node, collections.OrderedDict):
        return [(_dict_key(k, where), v) for k, v in node.items()]
    if isinstance(node, collections.defaultdict):
        return [(_dict_key(k, where), node[k]) for k in sorted(node)]
    return None


def _one_level(node: Any, where: Path) -> list[tuple[PathKey, Any]]:
    """(key, child) pairs of a registered pytree node; ValueError for a leaf.

    Where JAX is not imported no class can be registered with it, and the dict subclasses
    that JAX registers itself (what `state_dict()` returns is an OrderedDict) are taken
    apart here, in JAX's order: a checkpoint's structure never depends on whether JAX was
    imported."""
    jax = sys.modules.get("jax")
    if jax is None:
        children = dict_subclass_children(node, where)
        if children is None:
            raise ValueError("not a pytree node")
        return children
    one_level = getattr(jax.tree_util, "flatten_one_level_with_keys", None)
    if one_level is not None:
        pairs = list(one_level(node)[0])
    else:  # JAX before 0.4.36: flatten with every child a leaf.
        flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        if len(flat) == 1 and flat[0][0] == () and flat[0][1] is node:
            raise ValueError("not a pytree node")
        pairs = [(keypath[0], child) for keypath, child in flat]
    return [(_key_component(key, where), child) for key, child in pairs]


@dataclass(frozen=True)
class TargetTree:
    """A restore target taken apart: its leaves by path, and `rebuild`, which gives the
    target back with the leaf at each path replaced by `values[path]`."""

    paths: list[Path]
    leaves: list[Any]
    rebuild: Callable[[dict[Path, Any]], Any]


def flatten_target(target: Any, is_leaf: Callable[[Any], bool]) -> TargetTree:
    """Take a restore target apart. Where JAX is imported it flattens the target, so that
    registered nodes (Flax modules, optax states) come back as their classes; without JAX no
    such class can exist, and the containers `flatten` knows are rebuilt here. None is an
    empty subtree in both (it stays None)."""
    jax = sys.modules.get("jax")
    if jax is not None:
        flat, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=is_leaf)
        paths = [keypath_to_path(k) for k, _ in flat]
        return TargetTree(
            paths,
            [x for _, x in flat],
            lambda values: treedef.unflatten([values[p] for p in paths]),
        )
    tree = flatten(target, lambda x: x is not None and is_leaf(x))
    kept = [(p, x) for p, x in zip(tree.paths, tree.leaves, strict=True) if x is not None]
    return TargetTree(
        [p for p, _ in kept],
        [x for _, x in kept],
        lambda values: _replace_leaves(target, (), values),
    )


def _replace_leaves(node: Any, path: Path, values: dict[Path, Any]) -> Any:
    """`node` rebuilt with the leaves at the paths of `values` replaced (containers copied)."""
    if path in values:
        return values[path]
    if type(node) is dict:
        return {k: _replace_leaves(v, (*path, k), values) for k, v in node.items()}
    if type(node) is list:
        return [_replace_leaves(v, (*path, i), values) for i, v in enumerate(node)]
    if type(node) is tuple:
        return tuple(_replace_leaves(v, (*path, i), values) for i, v in enumerate(node))
    if _is_namedtuple(node):
        fields = node._fields
        return type(node)(*[_replace_leaves(getattr(node, f), (*path, f), values) for f in fields])
    if isinstance(node, collections.OrderedDict | collections.defaultdict):
        out = node.copy()
        for k in node:
            out[k] = _replace_leaves(node[k], (*path, k), values)
        return out
    return node


def empty_containers(node: Any, path: Path = ()) -> list[Path]:
    """Paths of the empty plain containers of a tree (dict, list, tuple, namedtuple,
    OrderedDict, defaultdict; registered classes are not entered): a restore target that
    has one where the checkpoint has leaves would restore none of them."""
    if type(node) in (dict, collections.OrderedDict, collections.defaultdict):
        items: list[tuple[PathKey, Any]] = list(node.items())
    elif type(node) in (list, tuple):
        items = list(enumerate(node))
    elif _is_namedtuple(node):
        items = list(zip(node._fields, node, strict=True))
    else:
        return []
    if not items:
        return [path]
    return [p for k, child in items for p in empty_containers(child, (*path, k))]


ABSENT: Any = object()
"""What `unflatten`'s leaf_values gives for a leaf to leave out (None in a list or tuple)."""


def unflatten(structure: JsonNode, leaf_values: Callable[[int], Any]) -> Any:
    """Rebuild plain containers from a stored structure; leaf i becomes `leaf_values(i)`,
    left out of its dict where that is ABSENT."""

    def build(node: Any) -> Any:
        if not isinstance(node, dict) or "t" not in node:
            raise CorruptCheckpointError(f"malformed tree node {node!r}")
        t = node["t"]
        if t == "leaf":
            return leaf_values(int(node["i"]))
        children = [build(c) for c in node.get("c", [])]
        if t == "dict" or t in ("namedtuple", "node"):
            return {k: c for k, c in zip(node["k"], children, strict=True) if c is not ABSENT}
        children = [None if c is ABSENT else c for c in children]
        if t == "list":
            return children
        if t == "tuple":
            return tuple(children)
        raise CorruptCheckpointError(f"unknown tree node type {t!r}")

    return build(structure)


class ClassesLostWarning(UserWarning):
    """A restore without a target turned namedtuples or other registered classes into dicts."""


def _classes(node: Any, path: Path, out: list[tuple[Path, str]]) -> None:
    """(path, class name) of every namedtuple or registered class node, in tree order."""
    if not isinstance(node, dict):
        return
    t = node.get("t")
    if t in ("namedtuple", "node"):
        out.append((path, str(node.get("name", "?"))))
    keys = node.get("k")
    for i, child in enumerate(node.get("c", [])):
        k = keys[i] if t in ("dict", "namedtuple", "node") and keys is not None else i
        _classes(child, (*path, k), out)


JAX_TARGET_HINT = (
    "pass a target to get the classes back, e.g. load(path, jax.eval_shape(init)) "
    "or load(path, nnx.eval_shape(init)) for Flax NNX (see docs/flax.md)"
)


def warn_lost_classes(structure: JsonNode, hint: str = JAX_TARGET_HINT) -> None:
    """Warn (ClassesLostWarning) when rebuilding `structure` without a target turns class
    instances into dicts: name the first one and say (`hint`) how to get the classes back.
    The warning points at the caller's line, the first frame outside snapshard."""
    lost: list[tuple[Path, str]] = []
    _classes(structure, (), lost)
    if not lost:
        return
    path, name = lost[0]
    where = f"{path_str(path)!r}" if path else "the root"
    more = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
    warnings.warn(
        f"restoring without a target: {where} was saved as {name}{more} and comes back as a "
        f"dict; {hint}",
        ClassesLostWarning,
        stacklevel=user_frame()[1],
    )


def user_frame() -> tuple[FrameType, int]:
    """The first frame outside snapshard (and the contextlib frames of its decorators) above
    the function that calls this, and its `stacklevel` as that function's warnings.warn
    sees it."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None:
        file = os.path.abspath(frame.f_code.co_filename)
        if not file.startswith(package) and file != contextlib.__file__:
            break
        frame, level = frame.f_back, level + 1
    return frame, level
