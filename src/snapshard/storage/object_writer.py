"""Writing one object-store file with bounded memory: held and sent in one request while it
is small, else uploaded in parts (PartWriter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from ..errors import StorageError
from .base import FileWriter
from .bucket import Upload, brief

if TYPE_CHECKING:
    from .object_client import ObjectClient

T = TypeVar("T")


class PartWriter(FileWriter):
    """A file uploaded in one request, or in parts once it outgrows one.

    Up to `single_request_bytes` the file's bytes are held, and go up in one request when
    it is closed: the caller's own buffers where it keeps them unchanged until then
    (`write_kept`: a save's staged arrays), else copies. A file that grows beyond that
    goes up in parts of `part_size` bytes: bytes are copied into part buffers (the caller
    may reuse its buffers once `write` returns); a full part is handed to the store's
    upload, which sends it and then frees it, and waits when too many parts are in flight,
    so memory stays bounded. Nothing is visible before `close` returns; `abort` cancels
    the upload.
    """

    def __init__(self, client: ObjectClient, rel: str):
        self.client = client
        self.rel = rel
        self.part_size = client.transfer.part_size
        self.single = client.transfer.single_request_bytes
        self._held: list[memoryview] = []  # the file so far, while it fits one request
        self._upload: Upload | None = None  # once it does not
        self._part = np.empty(0, dtype=np.uint8)
        self._fill = 0
        self.size = 0

    def write(self, data: memoryview) -> None:
        mv = _flat(data)
        if isinstance(mv.obj, bytes):  # immutable: nothing to copy
            self.write_kept(mv)
        elif self._holds(len(mv)):
            self._held.append(memoryview(bytes(mv)))
        else:
            self._to_parts(mv)

    def write_kept(self, data: memoryview) -> None:
        mv = _flat(data)
        if self._holds(len(mv)):
            self._held.append(mv)
        else:
            self._to_parts(mv)

    def _holds(self, n: int) -> bool:
        """Whether n more bytes still fit one request (counted as written if so); else the
        file goes up in parts from now on, beginning with what is held."""
        if self._upload is None and self.size + n <= self.single:
            self.size += n
            return True
        if self._upload is None:
            key = self.client.key(self.rel)
            client = self.client
            self._upload = client.call(
                "upload of", self.rel, lambda: client.api.open_upload(key, client.transfer)
            )
            held, self._held, self.size = self._held, [], 0
            for mv in held:
                self._to_parts(mv)
        return False

    def _to_parts(self, mv: memoryview) -> None:
        while len(mv):
            if not len(self._part):
                self._part = np.empty(self.part_size, dtype=np.uint8)
            n = min(len(mv), self.part_size - self._fill)
            self._part[self._fill : self._fill + n] = np.frombuffer(mv[:n], dtype=np.uint8)
            self._fill += n
            self.size += n
            mv = mv[n:]
            if self._fill == self.part_size:
                self._hand_over()

    def _hand_over(self) -> None:
        part = self._part[: self._fill]
        self._part = np.empty(0, dtype=np.uint8)
        self._fill = 0
        upload = self._upload
        assert upload is not None
        self._upload_call(lambda: upload.write(part.data))

    def _upload_call(self, fn: Callable[[], T]) -> T:
        try:
            return self.client.call("upload of", self.rel, fn)
        except FileNotFoundError as e:
            raise StorageError(
                f"{self.client.url}: upload of {self.rel!r} failed: {brief(e)}"
            ) from e

    def close(self) -> int:
        if self._upload is None:
            key, held = self.client.key(self.rel), self._held
            self._upload_call(lambda: self.client.api.put_pieces(key, held))
            self._held = []
            requests = {"put": 1}
        else:
            if self._fill:
                self._hand_over()
            requests = self._upload_call(self._upload.close)
        self.client.counter.add(**requests, bytes_sent=self.size)
        return self.size

    def abort(self) -> None:
        self._held = []
        self._part = np.empty(0, dtype=np.uint8)
        if self._upload is not None:
            self._upload.abort()


def _flat(data: memoryview) -> memoryview:
    return data.cast("B") if data.format != "B" or data.ndim != 1 else data
