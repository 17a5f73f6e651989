"""A reader of format v1 written only from docs/format.md, with json, NumPy, ml_dtypes and
crc32c: no snapshard imports in the reader itself."""

from __future__ import annotations

import json
from pathlib import Path

import crc32c
import ml_dtypes
import numpy as np

# ---- the independent reader -----------------------------------------------------------


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _value(v: dict):
    t = v["type"]
    return {
        "none": lambda: None,
        "bool": lambda: v["value"],
        "int": lambda: int(v["value"]),
        "float": lambda: float.fromhex(v["value"]),
        "str": lambda: v["value"],
    }[t]()


def read_checkpoint(directory: Path):
    doc = json.loads((directory / "manifest.json").read_bytes())
    assert doc["format"] == "snapshard" and doc["version"] == 1
    files = [directory / f["name"] for f in doc["files"]]

    def leaf(entry: dict):
        if entry["kind"] == "value":
            return _value(entry["value"])
        dt = _dtype(entry["dtype"])
        out = np.zeros(entry["shape"], dt)
        for c in entry["chunks"]:
            raw = files[c["file"]].read_bytes()[c["offset"] : c["offset"] + c["nbytes"]]
            crcs = [int(c["crc32c"][i : i + 8], 16) for i in range(0, len(c["crc32c"]), 8)]
            for b, want in enumerate(crcs):
                assert crc32c.crc32c(raw[b * c["block"] : (b + 1) * c["block"]]) == want
            box = tuple(slice(a, b) for a, b in zip(c["start"], c["stop"], strict=True))
            shape = [b - a for a, b in zip(c["start"], c["stop"], strict=True)]
            out[box] = np.frombuffer(raw, dt).reshape(shape)
        return out[()] if entry["kind"] == "scalar" else out

    def build(node: dict):
        t = node["t"]
        if t == "leaf":
            return leaf(doc["leaves"][node["i"]])
        kids = [build(c) for c in node["c"]]
        if t in ("dict", "namedtuple", "node"):
            return dict(zip(node["k"], kids, strict=True))
        return kids if t == "list" else tuple(kids)

    return build(doc["tree"])


# ---- the test ---------------------------------------------------------------------------


def test_a_reader_written_from_the_format_document_reads_a_sharded_checkpoint(ckpt):
    import jax

    import snapshard

    from conftest import mesh, sharded

    m = mesh(2, 4)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 32), dtype=np.float32)
    e = rng.standard_normal((16, 8), dtype=np.float32).astype(ml_dtypes.bfloat16)
    tree = {
        "params": {"w": sharded(w, m, None, "model"), "e": sharded(e, m, "data", "model")},
        "key": jax.random.key(9),
        "opt": (np.int32(3), [1.5, None, "adam", True, 2**65]),
        "big": np.arange(20000, dtype=np.int16),
    }
    snapshard.save(ckpt, tree)
    got = read_checkpoint(ckpt)
    assert got["params"]["w"].tobytes() == w.tobytes()
    assert got["params"]["e"].tobytes() == e.tobytes()
    assert got["key"].tolist() == np.asarray(jax.random.key_data(tree["key"])).tolist()
    assert got["opt"] == (np.int32(3), [1.5, None, "adam", True, 2**65])
    assert np.array_equal(got["big"], tree["big"])
