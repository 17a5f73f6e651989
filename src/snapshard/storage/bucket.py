"""The calls an object-store client makes on one bucket, whatever the store's own library.

`ObjectClient` counts requests, names objects in errors, splits long reads and bounds
memory; a `Bucket` only moves bytes through one library: obstore for S3, Azure and memory
(`obstore_bucket.py`), google-cloud-storage for GCS (`gcs_bucket.py`). Each bucket sorts its
library's exceptions into the few kinds of `Failure` the client reports differently.
"""

from __future__ import annotations

import enum
import io
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TransferConfig:
    """How data moves. Host memory held by transfers is bounded by these numbers:
    uploads, `part_size * (upload_concurrency + 1)` per writer (a file in parts, or
    whole files of up to `single_request_bytes` side by side); downloads,
    `max_inflight_bytes` per storage (plus the caller's destination buffers).

    A save to an object store cuts each process's data into files of at most `file_bytes`
    where its arrays' boxes allow (at most 32 files a process; None: as many files as
    writers), so that each goes up in one request: no multipart upload, no compose."""

    part_size: int = 16 << 20  # multipart part size
    upload_concurrency: int = 8  # parts of one file in flight
    single_request_bytes: int = 128 << 20  # a file up to this size goes up in one request
    file_bytes: int | None = 32 << 20  # a save's data files are cut to at most this size
    read_part_size: int = 16 << 20  # a longer read is split into concurrent ranged GETs
    read_concurrency: int = 16  # ranged GETs in flight for one read
    max_inflight_bytes: int = 256 << 20  # GET responses held at once

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "file_bytes" and self.file_bytes is None:
                continue
            if getattr(self, f.name) < 1:
                raise ValueError(f"TransferConfig.{f.name} must be positive")
        if self.part_size < 5 << 20:
            raise ValueError("TransferConfig.part_size must be at least 5 MiB (the S3 minimum)")


_S3_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")


def brief(e: BaseException) -> str:
    """The first line of a store library's error, without the XML body some servers send
    (the S3 error code kept from it)."""
    text = str(e)
    line = text.split("\n", 1)[0].split(": <?xml", 1)[0]
    code = _S3_CODE.search(text)
    if code and code.group(1) not in line:
        line += f" [{code.group(1)}]"
    return line[:400] or type(e).__name__


class Failure(enum.Enum):
    """What an exception of a store's library means to snapshard."""

    DENIED = "denied"  # credentials missing or wrong, or no permission
    NO_BUCKET = "no bucket"
    MISSING = "missing"  # the object does not exist
    EXISTS = "exists"  # a create-only write found the object already there
    FAILED = "failed"  # anything else the store answered, retries exhausted


class Upload(ABC):
    """One object being uploaded in parts; nothing is visible before `close` returns."""

    @abstractmethod
    def write(self, part: memoryview) -> None:
        """Send one part (every part but the last is `part_size` bytes). The caller does
        not touch the part's memory again."""

    @abstractmethod
    def close(self) -> dict[str, int]:
        """Finish the upload: the object appears whole. Returns the requests it took, by
        `RequestStats` field: `post` (starts, completions, composes), `put` (requests
        that carried its bytes), `delete` (temporary objects removed)."""

    @abstractmethod
    def abort(self) -> None:
        """Give up; the object never appears (best effort, never raises)."""


class Bucket(ABC):
    """One bucket (or container) through its store's library. Keys are full object keys."""

    store_name: str  # "S3", "GCS", "Azure Blob", "memory": for error messages
    credentials_hint: str  # what to set when the store refuses the credentials
    list_page: int = 1000  # keys per listing request

    @abstractmethod
    def put(self, key: str, data: bytes, *, create: bool) -> bool:
        """One-request write. With create, only if absent: False when the object exists."""

    @abstractmethod
    def put_pieces(self, key: str, pieces: Sequence[memoryview]) -> None:
        """The object written in one request from `pieces`, in order (unconditional: safe to
        retry). The pieces stay unchanged until this returns; nothing may keep them after."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object; FileNotFoundError-kind failure when it does not exist."""

    @abstractmethod
    def head(self, key: str) -> None:
        """Raises (a MISSING failure) when the object does not exist."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        """(key, size) of every object whose key starts with `prefix`."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete the objects; one already gone is not an error."""

    @abstractmethod
    def read_range_into(self, key: str, start: int, views: Sequence[memoryview]) -> int:
        """Bytes from `start` into the views, in order, as many as they hold; returns how
        many came (fewer when the object is shorter)."""

    @abstractmethod
    def open_upload(self, key: str, transfer: TransferConfig) -> Upload: ...

    @abstractmethod
    def classify(self, error: BaseException) -> Failure | None:
        """The kind of a failure of this library; None for an error that is not the
        store's (a bug), which is raised unchanged."""


class ViewSink(io.RawIOBase):
    """A write-only file filling a list of memoryviews in order: a store library's response
    body written straight into the caller's memory."""

    def __init__(self, views: Sequence[memoryview]):
        self._views = list(views)
        self._index = 0  # the view being filled
        self._fill = 0  # bytes of it filled
        self.capacity = sum(len(v) for v in self._views)
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        src = memoryview(data).cast("B")
        if self.written + len(src) > self.capacity:
            raise ValueError("the store sent more bytes than the range asked for")
        pos = 0
        while pos < len(src):
            view = self._views[self._index]
            n = min(len(view) - self._fill, len(src) - pos)
            view[self._fill : self._fill + n] = src[pos : pos + n]
            pos += n
            self._fill += n
            if self._fill == len(view):
                self._index, self._fill = self._index + 1, 0
        self.written += len(src)
        return len(src)
