"""Malformed safetensors files give clear errors naming the file and tensor, never a crash."""

from __future__ import annotations

import contextlib
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import snapshard.safetensors as sst
from snapshard.errors import CorruptCheckpointError, SnapshardError, UnsupportedLeafError
from snapshard.safetensors.header import build_header, parse_header


def raw_file(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(text) if length is None else length
    return struct.pack("<Q", n) + text + data


def entry(dtype="F32", shape=(2, 2), begin=0, end=16):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def write(tmp_path, content: bytes):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(content)
    return p


CASES = {
    "shorter than the length": (b"\x10\x00\x00", r"truncated.*fewer than the 8-byte"),
    "huge header size": (struct.pack("<Q", 1 << 60) + b"{}", r"header size \d+ exceeds the limit"),
    "header cut short": (raw_file({"w": entry()}, length=500), r"truncated: the header claims 500"),
    "bad json": (raw_file(b'{"w": {"dtype": "F32",'), r"not valid JSON"),
    "not utf-8": (raw_file(b'{"\xff": 1}  '), r"not valid JSON"),
    "not an object": (raw_file(b"[1, 2, 3]"), r"not a JSON object"),
    "duplicate key": (raw_file(b'{"w": {}, "w": {}}'), r"duplicate key 'w'"),
    "unknown dtype": (
        raw_file({"w": entry(dtype="F13")}, bytes(16)),
        r"tensor 'w': unknown dtype 'F13'",
    ),
    "wrong length": (
        raw_file({"w": entry(end=12)}, bytes(16)),
        r"tensor 'w'.*hold 12 bytes.*needs 16",
    ),
    "negative shape": (
        raw_file({"w": entry(shape=(-2, -2))}, bytes(16)),
        r"tensor 'w': malformed shape",
    ),
    "bool shape": (
        raw_file({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4)),
        r"malformed shape",
    ),
    "reversed offsets": (
        raw_file({"w": entry(begin=16, end=0)}, bytes(16)),
        r"tensor 'w': malformed data_offsets",
    ),
    "entry not an object": (raw_file({"w": 3}), r"tensor 'w': entry is not a JSON object"),
    "bad metadata": (raw_file({"__metadata__": {"a": 1}}), r"__metadata__ must map strings"),
    "overlapping": (
        raw_file({"a": entry(begin=0, end=16), "b": entry(begin=8, end=24)}, bytes(24)),
        r"tensors 'a' and 'b' overlap",
    ),
    "data truncated": (raw_file({"w": entry()}, bytes(10)), r"truncated: tensor 'w' ends at byte"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_files_are_refused_with_the_file_and_tensor_named(tmp_path, case):
    content, message = CASES[case]
    p = write(tmp_path, content)
    with pytest.raises(CorruptCheckpointError, match=message) as e:
        sst.load(p)
    assert "bad.safetensors" in str(e.value)


def test_bit_packed_dtypes_are_listed_but_refused_when_read(tmp_path):
    p = write(
        tmp_path, raw_file({"q": entry("F4", (4, 4), 0, 8), "w": entry(begin=8, end=24)}, bytes(24))
    )
    assert sst.load(p, {"w": np.zeros((2, 2), np.float32)})["w"].shape == (2, 2)
    with pytest.raises(UnsupportedLeafError, match=r"tensor 'q': dtype F4 is bit-packed"):
        sst.load(p)


def test_holes_between_tensors_and_padding_are_accepted(tmp_path):
    data = np.arange(4, dtype=np.float32).tobytes()
    p = write(
        tmp_path,
        raw_file(
            b'{"w": ' + json.dumps(entry(begin=8, end=24)).encode() + b"}     ", bytes(8) + data
        ),
    )
    assert np.array_equal(sst.load(p)["w"], np.arange(4, dtype=np.float32).reshape(2, 2))


def test_built_headers_parse_back_to_the_same_layout():
    header, spans = build_header([("a", "BF16", (3, 5)), ("b", "U8", (7,))], {"format": "pt"})
    assert len(header) % 8 == 0
    n = struct.unpack("<Q", header[:8])[0]
    parsed = parse_header(header[8 : 8 + n], "x.safetensors", None)
    assert parsed.metadata == {"format": "pt"}
    assert {k: (t.begin, t.end) for k, t in parsed.tensors.items()} == spans


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_mutated_files_never_crash_the_loader(tmp_path, data):
    good = raw_file({"a": entry(), "b": entry("I8", (3,), 16, 19)}, bytes(19))
    content = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        i = data.draw(st.integers(0, max(len(content) - 1, 0)))
        if op == "flip" and content:
            content[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del content[i:]
        else:
            content[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(bytes(content))
    with contextlib.suppress(SnapshardError):
        sst.load(p)
