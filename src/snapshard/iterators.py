"""Data iterators as checkpoint leaves: an iterator to a record of its state, and back.

Any object with `get_state()` and `set_state(state)` qualifies: Grain's `DataLoader`
iterators (whose state is UTF-8 JSON bytes) and dataset iterators (`MapDataset` /
`IterDataset`, whose state is a dict), and iterators of one's own with the same two methods.

A record is a small tree of Python values that a checkpoint stores as it stores any other
Python values, readable by `snapshard info`:

    {"iterator": "json_bytes", "state": {...}}   # bytes that hold JSON (Grain's DataLoader)
    {"iterator": "tree", "state": {...}}         # a state that is a tree of Python values
    {"iterator": "bytes", "state": b"..."}       # other bytes (needs bytes leaves)

Each process of a job has its own iterator position, so an iterator is a per-process value:
the save stores one record per process and the restore gives each process its own. This
module only turns one iterator into its record and back.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import SnapshardError, TargetMismatchError, UnsupportedLeafError

FORMATS = ("json_bytes", "tree", "bytes")
_PLAIN = (bool, int, float, str, type(None))


def is_checkpointable_iterator(x: Any) -> bool:
    """Whether `x` is an iterator with `get_state` and `set_state` (arrays and containers
    are not, even where they happen to have such attributes)."""
    if isinstance(x, dict | list | tuple | bytes | str) or hasattr(x, "__array__"):
        return False
    return callable(getattr(x, "get_state", None)) and callable(getattr(x, "set_state", None))


def is_data_iterator(x: Any) -> bool:
    """Whether a tree leaf is a data iterator saved as its position (one per process): an
    iterator (`__next__`) with `get_state`/`set_state`. Other objects with those two methods
    (Flax's RNG streams, for one) stay what they are in the tree."""
    return callable(getattr(x, "__next__", None)) and is_checkpointable_iterator(x)


def _check_tree(x: Any, where: str) -> None:
    if isinstance(x, _PLAIN):
        return
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str | int) or isinstance(k, bool):
                raise UnsupportedLeafError(f"{where}: state key {k!r} is not a str or int")
            _check_tree(v, f"{where}/{k}")
        return
    if isinstance(x, list | tuple):
        for i, v in enumerate(x):
            _check_tree(v, f"{where}/{i}")
        return
    raise UnsupportedLeafError(
        f"{where}: iterator state holds a {type(x).__name__}; only Python values, dicts, "
        "lists, tuples and bytes can be stored"
    )


def iterator_record(iterator: Any, *, leaf: str = "iterator") -> dict[str, Any]:
    """The record of `iterator`'s current position (see the module's doc)."""
    state = iterator.get_state()
    if isinstance(state, bytes | bytearray):
        try:
            parsed = json.loads(bytes(state).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return {"iterator": "bytes", "state": bytes(state)}
        _check_tree(parsed, leaf)
        return {"iterator": "json_bytes", "state": parsed}
    _check_tree(state, leaf)
    return {"iterator": "tree", "state": state}


def state_of_record(record: Any, *, leaf: str = "iterator") -> Any:
    """What `set_state` takes, from a record as a restore gives it back."""
    if (
        not isinstance(record, dict)
        or record.get("iterator") not in FORMATS
        or "state" not in record
    ):
        raise SnapshardError(
            f"leaf {leaf!r}: not an iterator record (expected {{'iterator': one of {FORMATS}, "
            f"'state': ...}}, got {type(record).__name__})"
        )
    kind, state = record["iterator"], record["state"]
    if kind == "json_bytes":
        return json.dumps(state, indent=4).encode("utf-8")
    if kind == "bytes":
        if not isinstance(state, bytes | bytearray):
            raise SnapshardError(
                f"leaf {leaf!r}: a bytes iterator record holds {type(state).__name__}"
            )
        return bytes(state)
    return state


def restore_iterator(iterator: Any, record: Any, *, leaf: str = "iterator") -> Any:
    """Move `iterator` to the position `record` describes; returns the iterator. An iterator
    that refuses the position (Grain checks a DataLoader's sampler and data source against
    those of the saved state) raises TargetMismatchError naming the leaf."""
    state = state_of_record(record, leaf=leaf)
    try:
        iterator.set_state(state)
    except (ValueError, KeyError, TypeError) as e:
        raise TargetMismatchError(
            f"leaf {leaf!r}: the target's {type(iterator).__name__} refused the saved position "
            f"({type(e).__name__}: {e})"
        ) from e
    return iterator
