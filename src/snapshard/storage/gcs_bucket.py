"""Google Cloud Storage buckets through google-cloud-storage (the JSON API).

The client finds its credentials the way Google's libraries do (application default
credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, the metadata server) and an
emulator through STORAGE_EMULATOR_HOST. The commit marker and the writer lease are created
with `ifGenerationMatch=0`, GCS's create-only precondition. A data file of up to
`TransferConfig.single_request_bytes` goes up in one request, a media upload
(`uploadType=media`, google-resumable-media's `SimpleUpload` on the client's authorized
session), its CRC32C checked against the one GCS computed; a larger file as a parallel
composite upload (parts as temporary objects side by side, then `compose`; invisible until
the last compose). Transient failures are retried by the library's own policy
(`DEFAULT_RETRY`: exponential backoff on 429, 5xx and dropped connections, 120 s per call).
"""

from __future__ import annotations

import base64
import contextlib
import threading
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from ..errors import StorageError
from .bucket import Bucket, Failure, TransferConfig, Upload, ViewSink

try:
    import google.auth.exceptions
    import google_crc32c
    import requests.adapters
    import requests.exceptions
    from google.api_core import exceptions as api_exceptions
    from google.api_core.retry import Retry
    from google.cloud import storage
    from google.cloud.storage.retry import DEFAULT_RETRY
    from google.resumable_media import common as resumable_common
    from google.resumable_media.requests import SimpleUpload
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
_MAX_ONE_REQUEST = 8 << 20  # google-cloud-storage sends larger uploads as a resumable session
MAX_COMPOSE = 32  # sources of one compose request (the JSON API's limit)
# Connections the client keeps open: more than a save or restore has requests in flight
# (16 ranged GETs of a read times the read threads, or writers times files or parts at
# once). requests keeps 10 by default, and a request beyond them opens a connection (a TLS
# handshake on real GCS) that is thrown away after it.
CONNECTIONS = 64
_LIBRARY_ERRORS = (
    api_exceptions.GoogleAPIError,
    google.auth.exceptions.GoogleAuthError,
    resumable_common.InvalidResponse,
    resumable_common.DataCorruption,
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
        pooled = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=CONNECTIONS)
        for scheme in ("https://", "http://"):
            self.client._http.mount(scheme, pooled)

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

    def put_pieces(self, key: str, pieces: Sequence[memoryview]) -> None:
        """A media upload: the bytes are the request's body. google-cloud-storage's own
        one-request upload builds a multipart body (four more copies of the file: 4.1 s of
        client CPU for 600 MiB on the emulator, against 0.9 s), and a resumable session
        takes two requests (and cost the emulator 1.5 to 2.5 times the CPU)."""
        data = b"".join(pieces)  # the library sends bytes only: the one copy of the file
        crc = google_crc32c.value(data)
        url = f"{self._upload_base}&name={urllib.parse.quote(key, safe='')}"

        def send() -> None:
            upload = SimpleUpload(url)  # sent through the client's authorized session
            # One attempt per call: `self.retry` retries the call (the library would retry
            # on its own too, for up to 600 s, as google-cloud-storage's uploads set it).
            upload._retry_strategy = resumable_common.RetryStrategy(max_retries=0)
            try:
                response = upload.transmit(
                    self.client._http, data, "application/octet-stream", timeout=self.timeout
                )
            except resumable_common.InvalidResponse as e:
                raise api_exceptions.from_http_response(e.response) from e
            stored = response.json().get("crc32c")
            if stored and base64.b64decode(stored) != crc.to_bytes(4, "big"):
                with contextlib.suppress(*_LIBRARY_ERRORS):  # what arrived is not the file
                    self.bucket.delete_blob(key, retry=self.retry, timeout=self.timeout)
                raise resumable_common.DataCorruption(
                    response,
                    f"the stored object's CRC32C ({stored}) is not that of the bytes sent",
                )

        self.retry(send)()

    @property
    def _upload_base(self) -> str:
        bucket = urllib.parse.quote(self.bucket.name, safe="")
        # The API's address: GCS, an emulator (STORAGE_EMULATOR_HOST) or client_options'.
        host = getattr(self.client, "api_endpoint", None) or self.client._connection.API_BASE_URL
        return f"{host}/upload/storage/v1/b/{bucket}/o?uploadType=media"

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

    def read_range_into(self, key: str, start: int, views: Sequence[memoryview]) -> int:
        # The body is read in one piece and written straight into the views (not 8 KiB
        # at a time into a buffer that is then copied twice). A download cut short is
        # retried by the library from the first byte the sink has not seen.
        sink = ViewSink(views)
        if not sink.capacity:
            return 0
        try:
            self.bucket.blob(key).download_to_file(
                sink,
                start=start,
                end=start + sink.capacity - 1,  # inclusive
                raw_download=True,
                checksum=None,  # snapshard checks its own crc32c per block
                single_shot_download=True,  # one read of the body, not 8 KiB at a time
                retry=self.retry,
                timeout=self.timeout,
            )
        except api_exceptions.RequestRangeNotSatisfiable:
            return 0  # the object ends before `start`: the caller reports it truncated
        return sink.written

    def upload_part(self, key: str, data: memoryview) -> None:
        """One unconditional upload (a part, or a file of one part): safe to retry."""
        # A session's single chunk must hold the whole part (its default is 100 MiB).
        chunk = -(-len(data) // _CHUNK_ALIGN) * _CHUNK_ALIGN
        blob = self.bucket.blob(key, chunk_size=max(chunk, _CHUNK_ALIGN))
        blob.upload_from_string(bytes(data), retry=self.retry, timeout=self.timeout)

    def compose(self, key: str, sources: Sequence[str]) -> None:
        """`key` becomes the concatenation of `sources` (at most MAX_COMPOSE). Composing
        the same sources again gives the same object: safe to retry."""
        blobs = [self.bucket.blob(name) for name in sources]
        self.bucket.blob(key).compose(blobs, retry=self.retry, timeout=self.timeout)

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
    """A file of several parts goes up as a parallel composite upload: each part is a
    temporary object of its own, up to `upload_concurrency` of them in flight (the writer
    blocks when that many are), then the JSON API's `compose` joins them into the object
    (32 sources a call, in a tree for more) and the parts are deleted. One session's
    chunks would go one after the other; parts go side by side. The object appears only
    at the last compose; a failure deletes the parts it made. A file of one part goes up
    in one request at `close`.

    Parts are named after the file (`<key>.part-<token>-<level>-<index>`), so that the
    save's own clean-up of a process's files, and the removal of an incomplete save,
    find them too (a process killed mid-upload leaves them until then)."""

    def __init__(self, bucket: GcsBucket, key: str, transfer: TransferConfig):
        self._bucket = bucket
        self._key = key
        self._concurrency = transfer.upload_concurrency
        self._slots = threading.Semaphore(transfer.upload_concurrency)
        self._token = uuid.uuid4().hex[:8]
        self._first: memoryview | None = None  # held until a second part comes
        self._parts: list[str] = []  # the temporary objects of level 0, in order
        self._made: list[str] = []  # every temporary object that may exist
        self._futures: list[Future[None]] = []
        self._error: BaseException | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._counts: Counter[str] = Counter()

    def _name(self, level: int, index: int) -> str:
        return f"{self._key}.part-{self._token}-{level}-{index:05d}"

    def write(self, part: memoryview) -> None:
        if self._first is None and not self._parts:
            self._first = part
            return
        if self._first is not None:
            first, self._first = self._first, None
            self._send_part(first)
        self._send_part(part)

    def _send_part(self, data: memoryview) -> None:
        """Upload one part in the background; waits while `upload_concurrency` are in
        flight, and raises the error of one that failed."""
        self._raise_failed()
        self._slots.acquire()
        if self._error is not None:  # failed while this part waited for a slot
            self._slots.release()
            raise self._error
        name = self._name(0, len(self._parts))
        self._parts.append(name)
        self._made.append(name)
        self._counts.update(_upload_requests(len(data)))
        future = self._executor().submit(self._bucket.upload_part, name, data)
        future.add_done_callback(self._part_done)
        self._futures.append(future)

    def _part_done(self, future: Future[None]) -> None:
        error = future.exception()
        if error is not None and self._error is None:
            self._error = error
        self._slots.release()

    def _raise_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._concurrency, thread_name_prefix="snapshard-gcs")
        return self._pool

    def close(self) -> dict[str, int]:
        if not self._parts:
            first, self._first = self._first, None
            data = first if first is not None else memoryview(b"")
            self._bucket.upload_part(self._key, data)
            return dict(_upload_requests(len(data)))
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        return dict(self._counts)

    def _finish(self) -> None:
        """Wait for the parts, compose them level by level, delete the temporary objects."""
        for future in self._futures:
            future.result()
        self._raise_failed()
        sources, level = self._parts, 1
        while len(sources) > MAX_COMPOSE:
            groups = [sources[i : i + MAX_COMPOSE] for i in range(0, len(sources), MAX_COMPOSE)]
            targets = [self._name(level, j) for j in range(len(groups))]
            self._made += targets
            self._in_parallel(self._bucket.compose, list(zip(targets, groups, strict=True)))
            self._counts["post"] += len(groups)
            sources, level = targets, level + 1
        self._bucket.compose(self._key, sources)
        self._counts["post"] += 1
        self._delete_made()

    def _in_parallel(self, fn: Callable[..., None], calls: list[tuple[Any, ...]]) -> None:
        """Every call ends before the first error is raised: a compose still in flight
        would otherwise make its object after the clean-up had deleted the name."""
        futures = [self._executor().submit(fn, *args) for args in calls]
        wait(futures)
        for future in futures:
            future.result()

    def _delete_made(self) -> None:
        # Forgotten only once all are gone: after a failure, abort tries them all again.
        self._in_parallel(self._bucket.delete, [([name],) for name in self._made])
        self._counts["delete"] += len(self._made)
        self._made = []
        self._shutdown()

    def _shutdown(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def abort(self) -> None:
        """Wait for the parts in flight (a request cannot be recalled), then delete every
        temporary object this upload made. Best effort: never raises."""
        self._first = None
        for future in self._futures:
            with contextlib.suppress(BaseException):
                future.result()
        self._futures = []
        with contextlib.suppress(Exception):
            self._delete_made()
        self._shutdown()


def _upload_requests(size: int) -> Counter[str]:
    """The requests google-cloud-storage makes for one upload of `size` bytes: one
    multipart POST up to its 8 MiB limit, else a resumable session (POST) and one PUT."""
    return Counter(put=1) if size <= _MAX_ONE_REQUEST else Counter(post=1, put=1)
