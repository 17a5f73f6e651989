"""Access to one object-store bucket through obstore: counted requests, clear errors,
multipart uploads with bounded memory, and concurrent ranged reads under a byte budget.

Transient failures (5xx, dropped connections, timeouts) are retried inside obstore with
exponential backoff, bounded by `max_retries` and `retry_timeout` (see DEFAULT_RETRY);
whatever still fails, and every permanent failure (credentials, permissions, missing
bucket), becomes a StorageError that names the URL and the object.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlparse

import numpy as np

from ..errors import CorruptCheckpointError, StorageError
from .base import FileWriter

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
        "object-store locations (s3://, gs://, az://, memory://) need obstore: "
        "pip install 'snapshard[objstore]'"
    ) from e

if TYPE_CHECKING:
    from obstore.store import ObjectStore

T = TypeVar("T")

DEFAULT_RETRY: dict[str, Any] = {
    "max_retries": 8,
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=10),
        "base": 2,
    },
    "retry_timeout": timedelta(seconds=120),
}
_S3_LIST_PAGE = 1000
_DENIED = ("status code: 403", "status code: 401", "AccessDenied", "SignatureDoesNotMatch")
_NO_BUCKET = ("NoSuchBucket", "ContainerNotFound", "bucket does not exist")
_S3_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_memory_stores: dict[str, MemoryStore] = {}
_memory_lock = threading.Lock()


@dataclass(frozen=True)
class TransferConfig:
    """How data moves. Host memory held by transfers is bounded by these numbers:
    uploads, `part_size * (upload_concurrency + 1)` per file being written; downloads,
    `max_inflight_bytes` per storage (plus the caller's destination buffers)."""

    part_size: int = 16 << 20  # multipart part size; smaller files go up in one PUT
    upload_concurrency: int = 8  # parts of one file in flight
    read_part_size: int = 16 << 20  # a longer read is split into concurrent ranged GETs
    read_concurrency: int = 16  # ranged GETs in flight for one read
    max_inflight_bytes: int = 256 << 20  # GET responses held at once

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"TransferConfig.{f.name} must be positive")
        if self.part_size < 5 << 20:
            raise ValueError("TransferConfig.part_size must be at least 5 MiB (the S3 minimum)")


@dataclass
class RequestStats:
    """Requests issued by snapshard (obstore's retries of one request are not counted again).

    post: multipart create and complete; delete: objects deleted (S3 deletes up to 1000 in
    one request); list: pages of up to 1000 keys.
    """

    put: int = 0
    get: int = 0
    head: int = 0
    list: int = 0
    delete: int = 0
    post: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def requests(self) -> int:
        return self.put + self.get + self.head + self.list + self.delete + self.post

    def __sub__(self, other: RequestStats) -> RequestStats:
        return RequestStats(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )

    def as_dict(self) -> dict[str, int]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["requests"] = self.requests
        return d


class _Counter:
    """Thread-safe RequestStats."""

    def __init__(self) -> None:
        self._stats = RequestStats()
        self._lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def snapshot(self) -> RequestStats:
        with self._lock:
            return RequestStats(
                **{f.name: getattr(self._stats, f.name) for f in fields(RequestStats)}
            )


class _ByteBudget:
    """Blocks while more than `limit` bytes are held; a single larger request waits for all."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used and self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key prefix) of an object-store URL."""
    u = urlparse(url)
    if not u.scheme:
        raise ValueError(f"{url!r} is not an object-store URL (e.g. s3://bucket/prefix)")
    if u.scheme != "memory" and not u.netloc:
        raise ValueError(f"{url!r}: the URL names no bucket")
    prefix = u.path.strip("/")
    _check_key(prefix, url)
    return u.scheme, u.netloc, prefix


def _check_key(key: str, where: str) -> None:
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"{where}: invalid object key {key!r} (empty, '.' or '..' segment)")


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
        raise StorageError(f"{scheme}://{bucket}: cannot configure the store: {_brief(e)}") from e


def _brief(e: BaseException) -> str:
    """The first line of an obstore error, with the S3 error code when there is one."""
    text = str(e)
    line = text.split("\n", 1)[0]
    line = line.split(": <?xml", 1)[0]
    code = _S3_CODE.search(text)
    if code and code.group(1) not in line:
        line += f" [{code.group(1)}]"
    return line[:400]


class ObjectClient:
    """One key prefix in one bucket. Children share the store, counters and read pool."""

    def __init__(
        self,
        url: str,
        options: Mapping[str, Any] | None = None,
        transfer: TransferConfig | None = None,
        *,
        _parent: ObjectClient | None = None,
        _prefix: str = "",
    ):
        self.scheme: str
        self.bucket: str
        self.prefix: str
        self.store: ObjectStore
        self.transfer: TransferConfig
        self._counter: _Counter
        self._shared: _ReadPool
        if _parent is not None:
            self.scheme, self.bucket = _parent.scheme, _parent.bucket
            self.prefix = _prefix
            self.store, self.transfer = _parent.store, _parent.transfer
            self._counter, self._shared = _parent._counter, _parent._shared
        else:
            self.scheme, self.bucket, self.prefix = split_url(url)
            self.store = make_store(self.scheme, self.bucket, options)
            self.transfer = transfer or TransferConfig()
            self._counter = _Counter()
            self._shared = _ReadPool(self.transfer)
        self.url = f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    # ---- naming ------------------------------------------------------------------------
    def child(self, name: str) -> ObjectClient:
        _check_key(name, self.url)
        prefix = f"{self.prefix}/{name}" if self.prefix else name
        return ObjectClient(self.url, _parent=self, _prefix=prefix)

    def sibling(self, name: str) -> ObjectClient:
        """The client of prefix `name` beside this one (a referenced checkpoint)."""
        _check_key(name, self.url)
        parent = self.prefix.rpartition("/")[0]
        prefix = f"{parent}/{name}" if parent else name
        return ObjectClient(self.url, _parent=self, _prefix=prefix)

    def key(self, rel: str) -> str:
        _check_key(rel, self.url)
        return f"{self.prefix}/{rel}" if self.prefix else rel

    @property
    def stats(self) -> RequestStats:
        return self._counter.snapshot()

    # ---- errors ------------------------------------------------------------------------
    def _call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        """Run one obstore call; permanent and exhausted failures become StorageError.
        A missing object stays FileNotFoundError (its meaning depends on the caller)."""
        name = rel or "(prefix)"
        try:
            return fn()
        except (AlreadyExistsError, PreconditionError, NotSupportedError):
            raise
        except (OSError, obstore.exceptions.BaseError) as e:
            # Listings report every failure as a generic error: classify by the status too.
            if isinstance(e, PermissionDeniedError | UnauthenticatedError) or any(
                m in str(e) for m in _DENIED
            ):
                raise StorageError(
                    f"{self.url}: access denied to {what} {name!r}; check the credentials "
                    f"and the bucket's permissions ({_brief(e)})"
                ) from e
            if any(m in str(e) for m in _NO_BUCKET):
                raise StorageError(
                    f"{self.url}: bucket {self.bucket!r} does not exist ({what} {name!r})"
                ) from e
            if isinstance(e, FileNotFoundError):
                raise
            raise StorageError(f"{self.url}: {what} {name!r} failed: {_brief(e)}") from e

    # ---- small objects -----------------------------------------------------------------
    def put(self, rel: str, data: bytes, *, create: bool = False) -> bool:
        """Write a small object in one PUT. With create, only if absent: False if it exists
        (where the store cannot do a conditional put, a plain PUT is made)."""
        key = self.key(rel)

        def put(mode: str) -> None:
            obstore.put(self.store, key, data, mode=mode, use_multipart=False)  # type: ignore[arg-type]

        self._counter.add(put=1, bytes_sent=len(data))
        try:
            self._call("write of", rel, lambda: put("create" if create else "overwrite"))
        except (AlreadyExistsError, PreconditionError):
            return False
        except NotSupportedError:
            self._counter.add(put=1, bytes_sent=len(data))
            self._call("write of", rel, lambda: put("overwrite"))
        return True

    def get(self, rel: str) -> bytes | None:
        """A whole object, or None if it does not exist."""
        key = self.key(rel)
        self._counter.add(get=1)
        try:
            data = self._call("read of", rel, lambda: bytes(obstore.get(self.store, key).bytes()))
        except FileNotFoundError:
            return None
        self._counter.add(bytes_received=len(data))
        return data

    def exists(self, rel: str) -> bool:
        key = self.key(rel)
        self._counter.add(head=1)
        try:
            self._call("lookup of", rel, lambda: obstore.head(self.store, key))
        except FileNotFoundError:
            return False
        return True

    def listing(self) -> dict[str, int]:
        """Every object under the prefix (recursively): name relative to the prefix -> size."""
        base = f"{self.prefix}/" if self.prefix else ""

        def run() -> dict[str, int]:
            out: dict[str, int] = {}
            for page in obstore.list(
                self.store, prefix=self.prefix or None, chunk_size=_S3_LIST_PAGE
            ):
                for meta in page:
                    path = meta["path"]
                    if path.startswith(base):
                        out[path[len(base) :]] = int(meta["size"])
            return out

        out = self._call("listing of", "", run)
        self._counter.add(list=max(1, -(-len(out) // _S3_LIST_PAGE)))
        return out

    def delete(self, rels: Sequence[str]) -> None:
        if not rels:
            return
        keys = [self.key(r) for r in rels]
        self._counter.add(delete=len(keys))
        with contextlib.suppress(FileNotFoundError):  # already gone
            self._call("deletion of", rels[0], lambda: obstore.delete(self.store, keys))

    # ---- data --------------------------------------------------------------------------
    def writer(self, rel: str) -> FileWriter:
        return PartWriter(self, rel)

    def read_into(self, rel: str, offset: int, views: Sequence[memoryview]) -> None:
        """Bytes [offset, offset + total) of an object into the views, in order. Reads longer
        than read_part_size are split into ranged GETs fetched concurrently."""
        flat = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        total = sum(len(v) for v in flat)
        part = self.transfer.read_part_size
        pieces = []
        pos = 0
        while pos < total:
            n = min(part, total - pos)
            pieces.append((offset + pos, _slice_views(flat, pos, n)))
            pos += n
        if len(pieces) <= 1:
            for start, vs in pieces:
                self._get_range(rel, start, vs)
            return
        self._shared.run([partial(self._get_range, rel, s, vs) for s, vs in pieces])

    def _get_range(self, rel: str, start: int, views: list[memoryview]) -> None:
        n = sum(len(v) for v in views)
        key = self.key(rel)
        budget = self._shared.budget
        budget.acquire(n)
        try:
            self._counter.add(get=1)
            try:
                data = self._call(
                    "read of",
                    rel,
                    lambda: obstore.get_range(self.store, key, start=start, end=start + n),
                )
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.url}: data file {rel!r} is missing") from None
            got = memoryview(data).cast("B")
            self._counter.add(bytes_received=len(got))
            if len(got) < n:
                raise CorruptCheckpointError(
                    f"{self.url}: file {rel!r} is truncated (wanted bytes up to {start + n})"
                )
            pos = 0
            for v in views:
                v[:] = got[pos : pos + len(v)]
                pos += len(v)
        finally:
            budget.release(n)

    def close(self) -> None:
        self._shared.close()


def _slice_views(views: list[memoryview], pos: int, n: int) -> list[memoryview]:
    """The views covering bytes [pos, pos + n) of the concatenation of `views`."""
    out = []
    for v in views:
        if pos >= len(v):
            pos -= len(v)
            continue
        take = min(len(v) - pos, n)
        out.append(v[pos : pos + take])
        n -= take
        pos = 0
        if n == 0:
            break
    return out


class _ReadPool:
    """Threads for the pieces of long reads, and the byte budget all reads share."""

    def __init__(self, transfer: TransferConfig):
        self.transfer = transfer
        self.budget = _ByteBudget(transfer.max_inflight_bytes)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, jobs: list[Callable[[], None]]) -> None:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.transfer.read_concurrency, thread_name_prefix="snapshard-get"
                )
            pool = self._pool
        futures = [pool.submit(j) for j in jobs]
        for f in futures:
            f.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False)


class PartWriter(FileWriter):
    """A file uploaded in parts of `part_size` bytes, `upload_concurrency` at a time.

    Bytes are copied into part buffers (the caller may reuse its buffers once `write`
    returns); a full part is handed to obstore, which uploads it and then frees it, and
    waits when too many parts are in flight, so memory stays bounded. A file smaller than
    one part goes up in a single PUT when it is closed. Nothing is visible before `close`
    returns; `abort` cancels the multipart upload.
    """

    def __init__(self, client: ObjectClient, rel: str):
        self.client = client
        self.rel = rel
        t = client.transfer
        self.part_size = t.part_size
        self._writer = client._call(
            "upload of",
            rel,
            lambda: obstore.open_writer(
                client.store,
                client.key(rel),
                buffer_size=t.part_size,
                max_concurrency=t.upload_concurrency,
            ),
        )
        self._part = np.empty(0, dtype=np.uint8)
        self._fill = 0
        self._parts = 0
        self.size = 0

    def _hand_over(self) -> None:
        part = self._part[: self._fill]
        self._part = np.empty(0, dtype=np.uint8)
        self._fill = 0
        self._parts += 1
        self._upload_call(lambda: self._writer.write(part.data))

    def _upload_call(self, fn: Callable[[], object]) -> None:
        try:
            self.client._call("upload of", self.rel, fn)
        except FileNotFoundError as e:
            raise StorageError(
                f"{self.client.url}: upload of {self.rel!r} failed: {_brief(e)}"
            ) from e

    def write(self, data: memoryview) -> None:
        mv = data.cast("B") if data.format != "B" or data.ndim != 1 else data
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

    def close(self) -> int:
        multipart = self._parts > 0
        if self._fill:
            self._hand_over()
        self._upload_call(self._writer.close)
        if multipart:
            self.client._counter.add(post=2, put=self._parts, bytes_sent=self.size)
        else:
            self.client._counter.add(put=1, bytes_sent=self.size)
        return self.size

    def abort(self) -> None:
        self._part = np.empty(0, dtype=np.uint8)
        # obstore aborts the multipart upload when its context exits with an error; an
        # upload that already failed or closed has nothing left to cancel.
        with contextlib.suppress(Exception):
            self._writer.__exit__(RuntimeError, RuntimeError("aborted"), None)
