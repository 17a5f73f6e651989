"""Access to one object-store bucket: counted requests, clear errors, and concurrent ranged
reads under a byte budget (its files are written by object_writer.py).

The bytes move through the store's own library behind `Bucket` (obstore for S3, Azure and
memory; google-cloud-storage for GCS). Transient failures are retried inside that library;
whatever still fails, and every permanent failure (credentials, permissions, missing bucket),
becomes a StorageError that names the store, the bucket and the object's key.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, TypeVar

from ..errors import CorruptCheckpointError, StorageError
from .base import slice_views
from .bucket import Bucket, Failure, TransferConfig, brief
from .location import parse_location

T = TypeVar("T")

GCS_SCHEMES = ("gs",)


@dataclass
class RequestStats:
    """Requests issued by snapshard (the store library's retries of one request are not
    counted again).

    post: multipart create and complete (GCS: resumable sessions' starts and composes);
    delete: objects deleted (GCS: a composite upload's parts too); list: pages of up to
    1000 keys.
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


class RequestCounter:
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
            return dataclasses.replace(self._stats)


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
    """(scheme, bucket, key prefix) of an object-store URL, checked."""
    where = parse_location(url)
    if not where.scheme:
        raise ValueError(f"{url!r} is not an object-store URL (e.g. s3://bucket/prefix)")
    if where.scheme != "memory" and not where.bucket:
        raise ValueError(f"{url!r}: the URL names no bucket")
    _check_key(where.path, url)
    return where.scheme, where.bucket, where.path


def _check_key(key: str, where: str) -> None:
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"{where}: invalid object key {key!r} (empty, '.' or '..' segment)")


def make_bucket(scheme: str, bucket: str, options: Mapping[str, Any] | None) -> Bucket:
    """The bucket of a URL's scheme, through that store's library (imported only here, so
    that an installation needs only the library of the stores it uses)."""
    if scheme in GCS_SCHEMES:
        from .gcs_bucket import GcsBucket

        return GcsBucket(bucket, options)
    from .obstore_bucket import ObstoreBucket

    return ObstoreBucket(scheme, bucket, options)


# The buckets of clients unpickled in this process (a writer process's saves), by scheme,
# bucket and options: a store's client is made once, not at every save.
_remade: dict[bytes, Bucket] = {}
_remade_lock = threading.Lock()


class ObjectClient:
    """One key prefix in one bucket. Children share the bucket, counters and read pool."""

    def __init__(
        self,
        url: str,
        options: Mapping[str, Any] | None = None,
        transfer: TransferConfig | None = None,
        *,
        parent: ObjectClient | None = None,
        prefix: str = "",
    ):
        self.scheme: str
        self.bucket: str
        self.prefix: str
        self.options: Mapping[str, Any] | None
        self.api: Bucket
        self.transfer: TransferConfig
        self.counter: RequestCounter
        self.reads: ReadPool
        if parent is not None:
            self.scheme, self.bucket = parent.scheme, parent.bucket
            self.prefix, self.options = prefix, parent.options
            self.api, self.transfer = parent.api, parent.transfer
            self.counter, self.reads = parent.counter, parent.reads
        else:
            self.scheme, self.bucket, self.prefix = split_url(url)
            self.options = options
            self.api = make_bucket(self.scheme, self.bucket, options)
            self.transfer = transfer or TransferConfig()
            self.counter = RequestCounter()
            self.reads = ReadPool(self.transfer)
        self.url = f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    # ---- another process's copy (a writer process) -------------------------------------
    def unportable(self) -> str | None:
        """Why a copy of this client cannot work in another process, or None."""
        if self.scheme == "memory":
            return "a memory:// store lives in its own process"
        try:
            pickle.dumps(self.options)
        except Exception as e:
            return f"its store options cannot be sent to another process ({type(e).__name__}: {e})"
        return None

    def __getstate__(self) -> dict[str, Any]:
        """Where it points and how it connects: the copy makes its own bucket (once per
        process and set of options) and counts its own requests."""
        keep = ("scheme", "bucket", "prefix", "options", "transfer", "url")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        key = pickle.dumps((self.scheme, self.bucket, self.options))
        with _remade_lock:
            if key not in _remade:
                _remade[key] = make_bucket(self.scheme, self.bucket, self.options)
            self.api = _remade[key]
        self.counter = RequestCounter()
        self.reads = ReadPool(self.transfer)

    # ---- naming ------------------------------------------------------------------------
    def child(self, name: str) -> ObjectClient:
        return ObjectClient(self.url, parent=self, prefix=self.key(name))

    def sibling(self, name: str) -> ObjectClient:
        """The client of prefix `name` beside this one (a referenced checkpoint)."""
        _check_key(name, self.url)
        parent = self.prefix.rpartition("/")[0]
        prefix = f"{parent}/{name}" if parent else name
        return ObjectClient(self.url, parent=self, prefix=prefix)

    def key(self, rel: str) -> str:
        _check_key(rel, self.url)
        return f"{self.prefix}/{rel}" if self.prefix else rel

    @property
    def stats(self) -> RequestStats:
        return self.counter.snapshot()

    # ---- errors ------------------------------------------------------------------------
    def call(self, what: str, rel: str, fn: Callable[[], T]) -> T:
        """Run one call of the store's library; permanent and exhausted failures become
        StorageError naming the store, bucket and key. A missing object stays
        FileNotFoundError (its meaning depends on the caller)."""
        try:
            return fn()
        except Exception as e:
            kind = self.api.classify(e)
            if kind is None or kind is Failure.EXISTS:
                raise
            # A write or a listing finds nothing only when the bucket itself is missing.
            if kind is Failure.MISSING and what in ("write of", "upload of", "listing of"):
                kind = Failure.NO_BUCKET
            if kind is Failure.MISSING:
                raise FileNotFoundError(f"{self.url}: {self.key(rel) if rel else rel}") from e
            raise self.storage_error(kind, what, rel, e) from e

    def storage_error(self, kind: Failure, what: str, rel: str, e: BaseException) -> StorageError:
        name = rel or "(prefix)"
        where = f"{self.api.store_name} bucket {self.bucket!r}, key {self.key(rel) or '(root)'!r}"
        if kind is Failure.DENIED:
            return StorageError(
                f"{self.url}: access denied to {what} {name!r} ({where}); check the "
                f"credentials and the bucket's permissions: {self.api.credentials_hint} "
                f"({brief(e)})"
            )
        if kind is Failure.NO_BUCKET:
            return StorageError(
                f"{self.url}: bucket {self.bucket!r} does not exist ({what} {name!r}, "
                f"{self.api.store_name})"
            )
        return StorageError(f"{self.url}: {what} {name!r} failed ({where}): {brief(e)}")

    # ---- small objects -----------------------------------------------------------------
    def put(self, rel: str, data: bytes, *, create: bool = False) -> bool:
        """Write a small object in one request. With create, only if absent: False if it
        exists (where the store cannot do a conditional put, a plain one is made)."""
        key = self.key(rel)
        self.counter.add(put=1, bytes_sent=len(data))
        return self.call("write of", rel, lambda: self.api.put(key, data, create=create))

    def get(self, rel: str) -> bytes | None:
        """A whole object, or None if it does not exist."""
        key = self.key(rel)
        self.counter.add(get=1)
        try:
            data = self.call("read of", rel, lambda: self.api.get(key))
        except FileNotFoundError:
            return None
        self.counter.add(bytes_received=len(data))
        return data

    def exists(self, rel: str) -> bool:
        key = self.key(rel)
        self.counter.add(head=1)
        try:
            self.call("lookup of", rel, lambda: self.api.head(key))
        except FileNotFoundError:
            return False
        return True

    def listing(self) -> dict[str, int]:
        """Every object under the prefix (recursively): name relative to the prefix -> size."""
        base = f"{self.prefix}/" if self.prefix else ""

        def run() -> dict[str, int]:
            return {
                path[len(base) :]: size
                for path, size in self.api.list(self.prefix)
                if path.startswith(base)
            }

        out = self.call("listing of", "", run)
        self.counter.add(list=max(1, -(-len(out) // self.api.list_page)))
        return out

    def delete(self, rels: Sequence[str]) -> None:
        if not rels:
            return
        keys = [self.key(r) for r in rels]
        self.counter.add(delete=len(keys))
        try:
            self.call("deletion of", rels[0], lambda: self.api.delete(keys))
        except FileNotFoundError:
            return  # already gone

    # ---- ranged reads ------------------------------------------------------------------
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
            pieces.append((offset + pos, slice_views(flat, pos, n)))
            pos += n
        if len(pieces) <= 1:
            for start, vs in pieces:
                self._get_range(rel, start, vs)
            return
        self.reads.run([partial(self._get_range, rel, s, vs) for s, vs in pieces])

    def _get_range(self, rel: str, start: int, views: list[memoryview]) -> None:
        n = sum(len(v) for v in views)
        key = self.key(rel)
        budget = self.reads.budget
        budget.acquire(n)
        try:
            self.counter.add(get=1)
            try:
                got = self.call("read of", rel, lambda: self.api.read_range_into(key, start, views))
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.url}: file {rel!r} is missing") from None
            self.counter.add(bytes_received=got)
            if got < n:
                raise CorruptCheckpointError(
                    f"{self.url}: file {rel!r} is truncated (wanted bytes up to {start + n})"
                )
        finally:
            budget.release(n)

    def close(self) -> None:
        self.reads.close()


class ReadPool:
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
