"""S3-compatible, Azure Blob and in-memory buckets through obstore.

Transient failures (5xx, dropped connections, timeouts) are retried inside obstore with
exponential backoff, bounded by `max_retries` and `retry_timeout` (see DEFAULT_RETRY).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import StorageError
from .bucket import Bucket, Failure, TransferConfig, Upload, ViewSink, brief

try:
    import obstore
    from obstore.exceptions import (
        AlreadyExistsError,
        NotSupportedError,
        PermissionDeniedError,
        PreconditionError,
        UnauthenticatedError,
    )
    from obstore.store import MemoryStore, from_url
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "s3://, az:// and memory:// locations need obstore: pip install 'snapshard[objstore]'"
    ) from e

if TYPE_CHECKING:
    from obstore.store import ObjectStore

DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": 8,
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=10),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=120),
}
STORE_NAMES = {"s3": "S3", "az": "Azure Blob", "azure": "Azure Blob", "abfs": "Azure Blob"}
CREDENTIALS_HINTS = {
    "S3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or run with an "
    "instance or web-identity role), and AWS_ENDPOINT_URL for an S3-compatible server",
    "Azure Blob": "set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or "
    "AZURE_STORAGE_SAS_KEY (or a service principal: AZURE_CLIENT_ID, AZURE_TENANT_ID, "
    "AZURE_CLIENT_SECRET); for Azurite AZURE_STORAGE_USE_EMULATOR=true",
}
_DENIED = ("status code: 403", "status code: 401", "AccessDenied", "SignatureDoesNotMatch")
_NO_BUCKET = ("NoSuchBucket", "ContainerNotFound", "bucket does not exist")
# Pieces of a ranged read's body handed over from obstore at a time: small enough that the
# allocator reuses their memory from one to the next (see read_range_into).
_STREAM_PIECE = 256 << 10
_memory_stores: dict[str, MemoryStore] = {}
_memory_lock = threading.Lock()


def make_store(scheme: str, bucket: str, options: Mapping[str, Any] | None) -> ObjectStore:
    """The obstore store of a bucket. memory:// stores are shared per bucket name in this
    process, so that a save and a load in one process see the same objects."""
    if scheme == "memory":
        if options:
            raise ValueError("memory:// stores take no options")
        with _memory_lock:
            return _memory_stores.setdefault(bucket, MemoryStore())
    opts = dict(options or {})
    opts.setdefault("retry_config", DEFAULT_RETRY)
    try:
        return from_url(f"{scheme}://{bucket}", **opts)
    except Exception as e:
        store = STORE_NAMES.get(scheme, scheme)
        raise StorageError(
            f"{scheme}://{bucket}: cannot configure the {store} store: {brief(e)}; "
            f"{CREDENTIALS_HINTS.get(store, 'check the store options')}"
        ) from e


class ObstoreBucket(Bucket):
    """A bucket of an obstore store (S3, Azure, memory)."""

    def __init__(self, scheme: str, bucket: str, options: Mapping[str, Any] | None):
        self.store = make_store(scheme, bucket, options)
        self.memory = scheme == "memory"
        self.store_name = STORE_NAMES.get(scheme, "memory")
        self.credentials_hint = CREDENTIALS_HINTS.get(self.store_name, "")

    def put(self, key: str, data: bytes, *, create: bool) -> bool:
        def put(mode: str) -> None:
            obstore.put(self.store, key, data, mode=mode, use_multipart=False)  # type: ignore[arg-type]

        try:
            put("create" if create else "overwrite")
        except (AlreadyExistsError, PreconditionError):
            return False
        except NotSupportedError:  # no conditional put on this store: see docs/objstore.md
            put("overwrite")
        return True

    def put_pieces(self, key: str, pieces: Sequence[memoryview]) -> None:
        # One PUT of the pieces as they are: obstore takes a list of buffers without a copy
        # on the Python side. A memory store would keep a lone buffer itself, not a copy of
        # it, so it gets one.
        payload = b"".join(pieces) if self.memory else list(pieces)
        obstore.put(self.store, key, payload, use_multipart=False)

    def get(self, key: str) -> bytes:
        return bytes(obstore.get(self.store, key).bytes())

    def head(self, key: str) -> None:
        obstore.head(self.store, key)

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        for page in obstore.list(self.store, prefix=prefix or None, chunk_size=self.list_page):
            for meta in page:
                yield meta["path"], int(meta["size"])

    def delete(self, keys: Sequence[str]) -> None:
        with contextlib.suppress(FileNotFoundError):  # already gone
            obstore.delete(self.store, list(keys))

    def read_range_into(self, key: str, start: int, views: Sequence[memoryview]) -> int:
        # The body is streamed into the views in pieces, not received whole into a buffer
        # of obstore's own first: that buffer is fresh memory each time, and touching it
        # page by page cost a restore more CPU than copying the bytes.
        sink = ViewSink(views)
        if not sink.capacity:
            return 0
        end = start + sink.capacity
        result = obstore.get(self.store, key, options={"range": (start, end)})
        for piece in result.stream(min_chunk_size=_STREAM_PIECE):
            sink.write(piece)
        return sink.written

    def open_upload(self, key: str, transfer: TransferConfig) -> Upload:
        return ObstoreUpload(
            obstore.open_writer(
                self.store,
                key,
                buffer_size=transfer.part_size,
                max_concurrency=transfer.upload_concurrency,
            )
        )

    def classify(self, error: BaseException) -> Failure | None:
        if isinstance(error, AlreadyExistsError | PreconditionError):
            return Failure.EXISTS
        if not isinstance(error, OSError | obstore.exceptions.BaseError):
            return None
        # Listings report every failure as a generic error: classify by the status too.
        text = str(error)
        if isinstance(error, PermissionDeniedError | UnauthenticatedError) or any(
            m in text for m in _DENIED
        ):
            return Failure.DENIED
        if any(m in text for m in _NO_BUCKET):
            return Failure.NO_BUCKET
        if isinstance(error, FileNotFoundError):
            return Failure.MISSING
        return Failure.FAILED


class ObstoreUpload(Upload):
    """obstore's writer: it uploads up to `upload_concurrency` parts at once and blocks
    when that many are in flight; a file of one part goes up in a single PUT."""

    def __init__(self, writer: Any):
        self._writer = writer
        self._parts = 0

    def write(self, part: memoryview) -> None:
        self._writer.write(part)
        self._parts += 1

    def close(self) -> dict[str, int]:
        self._writer.close()
        # More than one part: a multipart upload (create, parts, complete); else one PUT.
        return {"post": 2, "put": self._parts} if self._parts > 1 else {"put": 1}

    def abort(self) -> None:
        # obstore aborts the multipart upload when its context exits with an error; an
        # upload that already failed or closed has nothing left to cancel.
        with contextlib.suppress(Exception):
            self._writer.__exit__(RuntimeError, RuntimeError("aborted"), None)
