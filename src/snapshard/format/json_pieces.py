"""JSON text of a large document made in pieces, byte for byte what
`json.dumps(doc, separators=(",", ":"))` makes.

`json.dumps` runs in C and holds the interpreter for the whole document: the manifest of a
10,000-leaf checkpoint takes it for tens of milliseconds in one go, a stall for every
other thread of the process (the training loop, while an asynchronous save commits). Here
a large dict or list is encoded SLICE items at a time, so another thread gets the
interpreter between pieces; the text is the same.
"""

from __future__ import annotations

import json
from typing import Any

# Elements of a list encoded by one call.
SLICE = 256

_dumps = json.JSONEncoder(separators=(",", ":")).encode


def dumps(doc: Any) -> str:
    """`json.dumps(doc, separators=(",", ":"))`, encoded in pieces of at most SLICE items
    of a list or dict (a container of more, or holding one of more, is cut)."""
    if isinstance(doc, list) and _big(doc):
        return "[" + ",".join(_pieces(doc[a : a + SLICE]) for a in range(0, len(doc), SLICE)) + "]"
    if isinstance(doc, dict) and (_big(doc) or any(_big(v) for v in doc.values())):
        if not all(isinstance(k, str) for k in doc):
            return _dumps(doc)  # (json's own conversion of other keys)
        out: list[str] = []
        run: dict[str, Any] = {}
        for k, v in doc.items():
            if run and (_big(v) or len(run) == SLICE):
                out.append(_dumps(run)[1:-1])
                run = {}
            if _big(v):
                out.append(f"{_dumps(k)}:{dumps(v)}")
            else:
                run[k] = v
        if run:
            out.append(_dumps(run)[1:-1])
        return "{" + ",".join(out) + "}"
    return _dumps(doc)


def _pieces(items: list[Any]) -> str:
    """The elements of a slice of a list, comma-separated."""
    if any(_big(x) for x in items):
        return ",".join(dumps(x) for x in items)
    return _dumps(items)[1:-1]


def _big(x: Any) -> bool:
    return isinstance(x, (dict, list)) and len(x) > SLICE
