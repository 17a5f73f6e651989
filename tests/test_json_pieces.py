"""format.json_pieces gives json.dumps's text byte for byte, for documents of every shape
and for a manifest of many leaves."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from snapshard.format import json_pieces

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=5)
)
docs = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=12), st.dictionaries(st.text(max_size=4), inner, max_size=12)
    ),
    max_leaves=200,
)


@settings(max_examples=150, deadline=None)
@given(docs, st.integers(1, 4))
def test_the_text_is_json_dumps_s(doc, slice_):
    old = json_pieces.SLICE
    json_pieces.SLICE = slice_  # small slices: every container of more is cut
    try:
        assert json_pieces.dumps(doc) == json.dumps(doc, separators=(",", ":"))
    finally:
        json_pieces.SLICE = old


def test_a_document_of_many_leaves_and_a_big_tree():
    leaves = [
        {"path": ["p", i], "dtype": "float32", "shape": [64, 64], "x": [i] * 3} for i in range(3000)
    ]
    tree = {f"a{i}": {"leaf": i} for i in range(2000)}
    doc = {"format": "x", "checksum": "00000000", "tree": {"params": tree, "n": 1},
           "leaves": leaves, "extra": {1: "non-str key"}, "empty": {}, "list": []}  # fmt: skip
    assert json_pieces.dumps(doc) == json.dumps(doc, separators=(",", ":"))
