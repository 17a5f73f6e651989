"""The safetensors header: parse and validate it, or build it for an export.

A file is: 8 bytes little-endian N, N bytes of UTF-8 JSON (padded with spaces), then the data
buffer. The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
(offsets relative to the data buffer) and may hold "__metadata__", a str -> str map.
Nothing read from a header is trusted: every problem is a CorruptCheckpointError that names
the file and the tensor.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError
from .dtypes import DTYPES

LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_NDIM = 64
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a file: where its bytes are, relative to the start of the file."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    file: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int  # 8 + N
    data_end: int  # absolute end of the last tensor's bytes (the file's minimal size)


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """Bytes of a tensor; None where a bit-packed dtype does not fill whole bytes."""
    bits = math.prod(shape) * DTYPES[dtype][0]
    return bits // 8 if bits % 8 == 0 else None


def header_length(prefix: bytes, file: str) -> int:
    """N from the first 8 bytes of a file, checked against the limit."""
    if len(prefix) < LENGTH_BYTES:
        raise CorruptCheckpointError(
            f"safetensors file {file!r} is truncated: {len(prefix)} bytes, fewer than the 8-byte header length"
        )
    n = int.from_bytes(prefix[:LENGTH_BYTES], "little")
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"safetensors file {file!r}: header size {n} exceeds the limit of {MAX_HEADER_BYTES} bytes "
            "(not a safetensors file, or a corrupt one)"
        )
    if n < 2:
        raise CorruptCheckpointError(f"safetensors file {file!r}: header size {n} is too small")
    return n


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(raw: bytes, file: str, file_size: int | None = None) -> Header:
    """Validate the N header bytes of `file` (after the length) and describe its tensors.

    Checks: JSON object of well-formed entries, known dtypes, dtype x shape = byte length,
    offsets non-negative and non-overlapping, and within the file when its size is known.
    """
    where = f"safetensors file {file!r}"
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where}: header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: header is not a JSON object")
    meta = doc.pop(METADATA_KEY, None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CorruptCheckpointError(f"{where}: {METADATA_KEY} must map strings to strings")
    data_start = LENGTH_BYTES + len(raw)
    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        tensors[name] = _tensor_info(name, entry, where, data_start)
    spans = sorted((t for t in tensors.values() if t.nbytes), key=lambda t: (t.begin, t.end))
    for a, b in itertools.pairwise(spans):
        if b.begin < a.end:
            raise CorruptCheckpointError(
                f"{where}: tensors {a.name!r} and {b.name!r} overlap "
                f"(data offsets {a.begin - data_start}..{a.end - data_start} and "
                f"{b.begin - data_start}..{b.end - data_start})"
            )
    data_end = max((t.end for t in spans), default=data_start)
    if file_size is not None and data_end > file_size:
        last = max(spans, key=lambda t: t.end)
        raise CorruptCheckpointError(
            f"{where} is truncated: tensor {last.name!r} ends at byte {last.end}, the file has {file_size}"
        )
    return Header(file, tensors, dict(meta), data_start, data_end)


def _tensor_info(name: str, entry: Any, where: str, data_start: int) -> TensorInfo:
    at = f"{where}, tensor {name!r}"
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{at}: entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CorruptCheckpointError(f"{at}: unknown dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(_is_int(s) and s >= 0 for s in shape)
    ):
        raise CorruptCheckpointError(f"{at}: malformed shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CorruptCheckpointError(f"{at}: malformed data_offsets {offsets!r}")
    shp = tuple(shape)
    want = tensor_nbytes(dtype, shp)
    begin, end = offsets
    if want is None:
        raise CorruptCheckpointError(
            f"{at}: {math.prod(shp)} elements of {dtype} do not fill whole bytes"
        )
    if end - begin != want:
        raise CorruptCheckpointError(
            f"{at}: data_offsets {begin}..{end} hold {end - begin} bytes, "
            f"dtype {dtype} x shape {list(shp)} needs {want}"
        )
    return TensorInfo(name, dtype, shp, data_start + begin, data_start + end)


def build_header(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The bytes before the data buffer (length + JSON padded to 8 bytes) for tensors laid
    out back to back in the given order, and each tensor's absolute [begin, end)."""
    doc: dict[str, Any] = {}
    if metadata:
        doc[METADATA_KEY] = dict(metadata)
    rel: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, dtype, shape in entries:
        n = tensor_nbytes(dtype, shape)
        assert n is not None
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        rel[name] = (offset, offset + n)
        offset += n
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = LENGTH_BYTES + len(text)
    spans = {name: (start + a, start + b) for name, (a, b) in rel.items()}
    return len(text).to_bytes(LENGTH_BYTES, "little") + text, spans
