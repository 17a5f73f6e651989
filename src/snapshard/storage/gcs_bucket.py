"""Google Cloud Storage buckets through google-cloud-storage (the JSON API).

The client finds its credentials the way Google's libraries do (application default
credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, the metadata server) and an
emulator through STORAGE_EMULATOR_HOST. The commit marker and the writer lease are created
with `ifGenerationMatch=0`, GCS's create-only precondition. A file of several parts goes up
as a resumable upload (invisible until its last chunk); one of a single part in one request.
Transient failures are retried by the library's own policy (`DEFAULT_RETRY`: exponential
backoff on 429, 5xx and dropped connections, 120 s per call).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import StorageError
from .bucket import Bucket, Failure, TransferConfig, Upload

try:
    import google.auth.exceptions
    import requests.exceptions
    from google.api_core import exceptions as api_exceptions
    from google.api_core.retry import Retry
    from google.cloud import storage
    from google.cloud.storage.fileio import BlobWriter
    from google.cloud.storage.retry import DEFAULT_RETRY
    from google.resumable_media import common as resumable_common
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "gs:// locations need google-cloud-storage: pip install 'snapshard[gcs]'"
    ) from e

CREDENTIALS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, run "
    "`gcloud auth application-default login`, or run with a service account attached; "
    "for an emulator set STORAGE_EMULATOR_HOST (e.g. http://127.0.0.1:4443)"
)
_CHUNK_ALIGN = 256 << 10  # resumable-upload chunks are multiples of 256 KiB
_LIBRARY_ERRORS = (
    api_exceptions.GoogleAPIError,
    google.auth.exceptions.GoogleAuthError,
    resumable_common.InvalidResponse,
    requests.exceptions.RequestException,
)


def make_client(bucket: str, options: Mapping[str, Any] | None) -> storage.Client:
    """A client from google-cloud-storage's own keyword arguments (`project`,
    `credentials`, `client_options` …); without them, from the environment."""
    try:
        return storage.Client(**dict(options or {}))
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise StorageError(
            f"gs://{bucket}: no Google credentials found: {CREDENTIALS_HINT} ({e})"
        ) from e
    except Exception as e:
        raise StorageError(f"gs://{bucket}: cannot configure the GCS client: {e}") from e


class GcsBucket(Bucket):
    """A GCS bucket. `options` are google-cloud-storage `Client` arguments, plus
    `retry` (a google.api_core Retry) and `timeout` (seconds per request)."""

    store_name = "GCS"
    credentials_hint = CREDENTIALS_HINT

    def __init__(self, bucket: str, options: Mapping[str, Any] | None):
        opts = dict(options or {})
        self.retry: Retry = opts.pop("retry", DEFAULT_RETRY)
        self.timeout: float = float(opts.pop("timeout", 60.0))
        self.client = make_client(bucket, opts)
        self.bucket = self.client.bucket(bucket)

    def put(self, key: str, data: bytes, *, create: bool) -> bool:
        # An unconditional write of the same bytes is safe to repeat: retry it too.
        condition = {"if_generation_match": 0} if create else {}
        try:
            self.bucket.blob(key).upload_from_string(
                bytes(data), retry=self.retry, timeout=self.timeout, **condition
            )
        except api_exceptions.PreconditionFailed:
            return False
        return True

    def get(self, key: str) -> bytes:
        blob = self.bucket.blob(key)
        return bytes(blob.download_as_bytes(retry=self.retry, timeout=self.timeout))

    def head(self, key: str) -> None:
        if self.bucket.get_blob(key, retry=self.retry, timeout=self.timeout) is None:
            raise FileNotFoundError(key)

    def list(self, prefix: str) -> Iterator[tuple[str, int]]:
        blobs = self.client.list_blobs(
            self.bucket,
            prefix=prefix or None,
            page_size=self.list_page,
            fields="items(name,size),nextPageToken",
            retry=self.retry,
            timeout=self.timeout,
        )
        for blob in blobs:
            yield blob.name, int(blob.size or 0)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                self.bucket.delete_blob(key, retry=self.retry, timeout=self.timeout)
            except api_exceptions.NotFound:
                continue  # already gone

    def get_range(self, key: str, start: int, end: int) -> Any:
        try:
            return self.bucket.blob(key).download_as_bytes(
                start=start,
                end=end - 1,  # inclusive
                raw_download=True,
                checksum=None,  # snapshard checks its own crc32c per block
                retry=self.retry,
                timeout=self.timeout,
            )
        except api_exceptions.RequestRangeNotSatisfiable:
            return b""  # the object ends before `start`: the caller reports it truncated

    def open_upload(self, key: str, transfer: TransferConfig) -> Upload:
        return GcsUpload(self, key, transfer)

    def classify(self, error: BaseException) -> Failure | None:
        if isinstance(error, api_exceptions.PreconditionFailed):
            return Failure.EXISTS
        if isinstance(
            error,
            api_exceptions.Forbidden
            | api_exceptions.Unauthorized
            | google.auth.exceptions.GoogleAuthError,
        ):
            return Failure.DENIED
        if isinstance(error, api_exceptions.NotFound | FileNotFoundError):
            return Failure.MISSING
        if isinstance(error, _LIBRARY_ERRORS):
            return Failure.FAILED
        return None


class GcsUpload(Upload):
    """Parts go up through a resumable session, opened once a second part comes (a file of
    one part goes up in one request at `close`). The object appears when the last chunk
    is sent; an upload left unfinished is never visible and GCS drops it after a week.

    The JSON API takes a session's chunks one after the other, so a chunk holds
    `upload_concurrency` parts: the memory S3's parallel parts would hold, in fewer round
    trips (each chunk is a request; 16 MiB chunks took twice as long as 128 MiB ones)."""

    def __init__(self, bucket: GcsBucket, key: str, transfer: TransferConfig):
        self._bucket = bucket
        chunk = transfer.part_size * transfer.upload_concurrency
        self._blob = bucket.bucket.blob(
            key, chunk_size=max(_CHUNK_ALIGN, chunk // _CHUNK_ALIGN * _CHUNK_ALIGN)
        )
        self._pending: memoryview | None = None
        self._session: BlobWriter | None = None
        self._size = 0

    def write(self, part: memoryview) -> None:
        if self._pending is not None:
            if self._session is None:
                self._session = BlobWriter(
                    self._blob,
                    ignore_flush=True,
                    retry=self._bucket.retry,
                    timeout=self._bucket.timeout,
                )
            self._session.write(self._pending)
        self._pending = part
        self._size += len(part)

    def close(self) -> tuple[int, int]:
        pending, self._pending = self._pending, None
        if self._session is None:
            self._blob.upload_from_string(
                bytes(pending or b""), retry=self._bucket.retry, timeout=self._bucket.timeout
            )
            return 0, 1
        if pending is not None:
            self._session.write(pending)
        self._session.close()
        chunk = self._blob.chunk_size or self._size
        return 1, -(-self._size // chunk)  # the session's start; its chunks

    def abort(self) -> None:
        # The session is never finished, so the object never appears.
        self._pending = None
        self._session = None
