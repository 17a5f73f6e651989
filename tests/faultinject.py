"""Fail the N-th call of one storage operation, at the boundary between snapshard's storage
layer and the system below it (system calls on local disk, obstore calls on object stores).

`FaultInjector.install(monkeypatch)` routes the calls of snapshard.storage's local,
local_files, atomic_rename, local_root, obstore_bucket and gcs_bucket through counting
wrappers:

    local   open write fsync read pread mkdir list rename link unlink rmdir read_file rmtree
    object  s3.put s3.get s3.head s3.list s3.delete
            s3.put_file (a file sent in one request)
            s3.open_upload s3.upload_part s3.close_upload, and on GCS s3.compose

The object operations have the same names on every store (S3, Azure and memory through
obstore; GCS through google-cloud-storage, where each wrapped `GcsBucket` method is one call
of that library and a composite upload's parts, each an upload of its own, are its
`s3.upload_part`s, made from the upload's threads). `s3.put_file` is the bucket's
`put_pieces`, on every store (on obstore's stores its PUT also counts as an `s3.put`).

With nothing armed the calls pass through and are counted (`counts`), so a fault-free run
enumerates every operation index of a save or a restore; `arm(op, k)` makes the k-th call
(0-based) of `op` fail, once, with an error carrying "injected fault": an OSError (EIO) on
local disk, an obstore GenericError on obstore's stores, a 503 (ServiceUnavailable, raised
where the library's retries no longer apply) on GCS. `shutil.rmtree(ignore_errors=True)`
fails the way it really does: silently, leaving the tree in place.
"""

from __future__ import annotations

import errno
import os
import pathlib
import shutil
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import obstore
from obstore.exceptions import GenericError

from snapshard.storage import atomic_rename, local, local_files, local_root, obstore_bucket

try:
    from google.api_core.exceptions import ServiceUnavailable

    from snapshard.storage import gcs_bucket
except ImportError:  # no google-cloud-storage: no GCS faults to inject
    gcs_bucket = None  # type: ignore[assignment]

INJECTED = "injected fault"


class InjectedFault(Exception):
    """Raised by nothing: marks where a fault was armed but never reached."""


class FaultInjector:
    def __init__(self, under: str | os.PathLike[str] | None = None):
        # Local path operations count only below `under` (None: all of them).
        self.under = os.fspath(under) if under is not None else None
        self.counts: Counter[str] = Counter()
        self.armed: tuple[str, int] | None = None
        self.fired: str | None = None  # what failed, once it did
        self.trace: list[str] = []  # every call since the last reset or arm, in order
        self._lock = threading.Lock()

    # ---- control -----------------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.trace.clear()
            self.armed = None
            self.fired = None

    def arm(self, op: str, index: int) -> None:
        with self._lock:
            self.counts.clear()
            self.trace.clear()
            self.armed = (op, index)
            self.fired = None

    def points(self) -> list[tuple[str, int]]:
        """Every (operation, index) the last run made, in a stable order."""
        return [(op, k) for op in sorted(self.counts) for k in range(self.counts[op])]

    def _hit(self, op: str, detail: object) -> bool:
        """Count one call of `op`; True if it is the armed one (which then fails)."""
        with self._lock:
            k = self.counts[op]
            self.counts[op] += 1
            self.trace.append(f"{op} #{k} {detail}")
            if self.armed == (op, k):
                self.armed = None
                self.fired = f"{op} #{k} ({detail})"
                return True
        return False

    def _mine(self, path: object) -> bool:
        if self.under is None:
            return True
        try:
            return os.fspath(path).startswith(self.under)  # type: ignore[arg-type]
        except TypeError:
            return False

    def _oserror(self, op: str, path: object) -> OSError:
        return OSError(errno.EIO, f"Input/output error ({INJECTED}: {self.fired})", str(path))

    # ---- local disk ----------------------------------------------------------------------
    def _wrap_path(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            where = path
            dir_fd = kwargs.get("dir_fd")
            if dir_fd is not None:
                where = f"{self._fd_paths.get(dir_fd, '?')}/{os.fspath(path)}"
            if (dir_fd is not None or self._mine(path)) and self._hit(op, where):
                raise self._oserror(op, where)
            out = fn(path, *args, **kwargs)
            if op == "open" and isinstance(out, int):
                self._fd_paths[out] = os.fspath(where)
            return out

        return call

    def _wrap_fd(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(fd: int, *args: Any, **kwargs: Any) -> Any:
            where = self._fd_paths.get(fd)
            if where is not None and self._hit(op, where):
                raise self._oserror(op, where)
            return fn(fd, *args, **kwargs)

        return call

    def _os_proxy(self) -> Any:
        injector = self
        wrapped = {
            "open": self._wrap_path("open", os.open),
            "makedirs": self._wrap_path("mkdir", os.makedirs),
            "scandir": self._wrap_path("list", os.scandir),
            "rename": self._wrap_path("rename", os.rename),
            "replace": self._wrap_path("rename", os.replace),
            "link": self._wrap_path("link", os.link),
            "unlink": self._wrap_path("unlink", os.unlink),
            "write": self._wrap_fd("write", os.write),
            "fsync": self._wrap_fd("fsync", os.fsync),
            "read": self._wrap_fd("read", os.read),
            "preadv": self._wrap_fd("pread", os.preadv),
        }

        def close(fd: int) -> None:
            injector._fd_paths.pop(fd, None)
            os.close(fd)

        wrapped["close"] = close

        class OsProxy:
            def __getattr__(self, name: str) -> Any:
                return wrapped.get(name) or getattr(os, name)

        return OsProxy()

    def _shutil_proxy(self) -> Any:
        injector = self

        def rmtree(path: Any, ignore_errors: bool = False, **kwargs: Any) -> None:
            if injector._mine(path) and injector._hit("rmtree", path):
                if ignore_errors:
                    return  # a failed best-effort removal leaves the tree
                raise injector._oserror("rmtree", path)
            shutil.rmtree(path, ignore_errors=ignore_errors, **kwargs)

        class ShutilProxy:
            def __getattr__(self, name: str) -> Any:
                return rmtree if name == "rmtree" else getattr(shutil, name)

        return ShutilProxy()

    def _path_method(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        injector = self

        def method(self: pathlib.Path, *args: Any, **kwargs: Any) -> Any:
            if injector._mine(self) and injector._hit(op, self):
                raise injector._oserror(op, self)
            return fn(self, *args, **kwargs)

        return method

    # ---- object stores -------------------------------------------------------------------
    def _obstore_proxy(self) -> Any:
        injector = self

        def counted(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(store: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
                detail = path if isinstance(path, str) else ", ".join(path)
                if injector._hit(op, detail):
                    raise GenericError(f"{INJECTED}: {injector.fired}")
                return fn(store, path, *args, **kwargs)

            return call

        def listing(store: Any, *args: Any, **kwargs: Any) -> Any:
            if injector._hit("s3.list", kwargs.get("prefix")):
                raise GenericError(f"{INJECTED}: {injector.fired}")
            return obstore.list(store, *args, **kwargs)

        class Upload:
            def __init__(self, inner: Any, key: str):
                self.inner, self.key = inner, key

            def write(self, data: Any) -> Any:
                if injector._hit("s3.upload_part", self.key):
                    raise GenericError(f"{INJECTED}: {injector.fired}")
                return self.inner.write(data)

            def close(self) -> Any:
                if injector._hit("s3.close_upload", self.key):
                    self.inner.__exit__(RuntimeError, RuntimeError("aborted"), None)
                    raise GenericError(f"{INJECTED}: {injector.fired}")
                return self.inner.close()

            def __exit__(self, *exc: Any) -> Any:
                return self.inner.__exit__(*exc)

        def open_writer(store: Any, key: str, **kwargs: Any) -> Upload:
            if injector._hit("s3.open_upload", key):
                raise GenericError(f"{INJECTED}: {injector.fired}")
            return Upload(obstore.open_writer(store, key, **kwargs), key)

        wrapped = {
            "put": counted("s3.put", obstore.put),
            "get": counted("s3.get", obstore.get),
            "head": counted("s3.head", obstore.head),
            "delete": counted("s3.delete", obstore.delete),
            "list": listing,
            "open_writer": open_writer,
        }

        class ObstoreProxy:
            def __getattr__(self, name: str) -> Any:
                return wrapped.get(name) or getattr(obstore, name)

        return ObstoreProxy()

    def _put_file(self, fn: Callable[..., Any], error: type[Exception]) -> Callable[..., Any]:
        injector = self

        def call(bucket: Any, key: str, pieces: Any) -> Any:
            if injector._hit("s3.put_file", key):
                raise error(f"{INJECTED}: {injector.fired}")
            return fn(bucket, key, pieces)

        return call

    # ---- GCS -----------------------------------------------------------------------------
    def _gcs_wrappers(self) -> dict[tuple[Any, str], Callable[..., Any]]:
        """(class, method) -> its counting wrapper, for GcsBucket and GcsUpload."""
        injector = self

        def counted(op: str, fn: Callable[..., Any], detail: Callable[..., str]) -> Any:
            def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
                if injector._hit(op, detail(obj, *args)):
                    raise ServiceUnavailable(f"{INJECTED}: {injector.fired}")
                return fn(obj, *args, **kwargs)

            return call

        def key(obj: Any, k: Any = "", *rest: Any) -> str:
            return k if isinstance(k, str) else ", ".join(k)

        bucket, upload = gcs_bucket.GcsBucket, gcs_bucket.GcsUpload
        ops = {
            (bucket, "put"): "s3.put",
            (bucket, "get"): "s3.get",
            (bucket, "head"): "s3.head",
            (bucket, "list"): "s3.list",
            (bucket, "delete"): "s3.delete",
            (bucket, "open_upload"): "s3.open_upload",
            (bucket, "upload_part"): "s3.upload_part",
            (bucket, "compose"): "s3.compose",
        }
        out = {(c, m): counted(op, getattr(c, m), key) for (c, m), op in ops.items()}
        out[(upload, "close")] = counted("s3.close_upload", upload.close, lambda u: u._key)
        out[(bucket, "put_pieces")] = self._put_file(bucket.put_pieces, ServiceUnavailable)
        return out

    # ---- installing ----------------------------------------------------------------------
    def install(self, monkeypatch: Any) -> FaultInjector:
        self._fd_paths: dict[int, str] = {}
        proxy = self._os_proxy()
        for module in (local, local_files, atomic_rename, local_root):
            monkeypatch.setattr(module, "os", proxy)
        for module in (local, atomic_rename, local_root):
            monkeypatch.setattr(module, "shutil", self._shutil_proxy())
        real_exchange = atomic_rename._exchange

        def exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
            if self._mine(a) and self._hit("rename", f"{a} <-> {b}"):
                raise self._oserror("rename", a)
            return real_exchange(a, b)

        monkeypatch.setattr(atomic_rename, "_exchange", exchange)
        for name, op in (("unlink", "unlink"), ("rmdir", "rmdir"), ("read_bytes", "read_file")):
            monkeypatch.setattr(
                pathlib.Path, name, self._path_method(op, getattr(pathlib.Path, name))
            )
        monkeypatch.setattr(obstore_bucket, "obstore", self._obstore_proxy())
        put_file = obstore_bucket.ObstoreBucket.put_pieces
        monkeypatch.setattr(
            obstore_bucket.ObstoreBucket, "put_pieces", self._put_file(put_file, GenericError)
        )
        if gcs_bucket is not None:
            for (cls, name), wrapper in self._gcs_wrappers().items():
                monkeypatch.setattr(cls, name, wrapper)
        return self
