"""Object-store storage (S3-compatible, GCS, Azure, memory): commit by a marker written last.

Object stores have no rename, so a save writes its files in place under the checkpoint's
prefix, then `manifest.json`, then the empty object `COMMITTED`, created only if absent
(a conditional PUT where the store offers one). A checkpoint exists if and only if its
marker exists; `delete` removes the marker first. A prefix without its marker is an
unfinished save or delete: invisible to readers, listed as incomplete by ObjectRoot and
removed by `remove_incomplete`. See docs/format.md and docs/objstore.md.

Overwriting a committed checkpoint replaces `manifest.json` in one PUT (readers see the old
or the new one whole) and only then deletes the files that only the old manifest names.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
)
from ..format.manifest import Manifest
from ..format.naming import DATA_DIR, INDEX_DIR, MANIFEST_NAME, RETAINED_MARKER
from ..format.refs import split_ref_name
from .base import CheckpointRoot, FileWriter, Storage
from .bucket import TransferConfig
from .lease import LEASE_DIR, LeaseFiles
from .object_client import ObjectClient, RequestStats
from .object_writer import PartWriter

log = logging.getLogger("snapshard")

COMMIT_MARKER = "COMMITTED"
_PROTOCOL_FILES = (MANIFEST_NAME, COMMIT_MARKER)
_SAVED_DIRS = (DATA_DIR, INDEX_DIR)  # what a save writes below its prefix


class ObjectStorage(Storage):
    """One checkpoint under an object-store prefix, e.g. ``s3://bucket/run/step_100``.

    `options` are obstore's store options (``endpoint``, ``region``, ``access_key_id`` …,
    plus ``client_options``, ``retry_config`` and ``credential_provider``); anything not
    given comes from the usual environment variables. `transfer` sets part sizes,
    concurrency and memory bounds. `stats` counts the requests made so far.
    """

    def __init__(
        self,
        url: str,
        options: Mapping[str, Any] | None = None,
        *,
        transfer: TransferConfig | None = None,
        client: ObjectClient | None = None,
    ):
        self.client = client or ObjectClient(url, options, transfer)
        self.url = self.client.url

    @property
    def stats(self) -> RequestStats:
        return self.client.stats

    def unportable(self) -> str | None:
        return self.client.unportable()

    def __getstate__(self) -> dict[str, Any]:
        """The client's location and options, for a writer process: not the commit guard,
        which the writer asks the training process to run."""
        state = dict(self.__dict__)
        state.pop("commit_guard", None)
        return state

    def requests_made(self) -> RequestStats:
        return self.client.stats

    def add_requests(self, made: RequestStats) -> None:
        self.client.counter.add(**dataclasses.asdict(made))

    @property
    def data_file_bytes(self) -> int | None:  # type: ignore[override]
        """Files a save cuts to go up in one request each (TransferConfig.file_bytes)."""
        t = self.client.transfer
        return None if t.file_bytes is None else min(t.file_bytes, t.single_request_bytes)

    @property
    def upload_bytes_per_writer(self) -> int:  # type: ignore[override]
        """What a file in parts holds in flight (`part_size * (upload_concurrency + 1)`):
        as many whole files as fit in it go up side by side."""
        t = self.client.transfer
        return t.part_size * (t.upload_concurrency + 1)

    def _committed_files(self) -> set[str] | None:
        """Names the committed manifest refers to; None when nothing is committed."""
        if not self.client.exists(COMMIT_MARKER):
            return None
        data = self.client.get(MANIFEST_NAME)
        if data is None:
            return set()
        return _files_of(data, self.url)

    def _staged(self, listing: dict[str, int]) -> dict[str, int]:
        keep = self._committed_files() or set()
        return {n: s for n, s in listing.items() if n not in _PROTOCOL_FILES and n not in keep}

    # ---- save side: files are staged in place ------------------------------------------
    def prepare_staging(self) -> None:
        return None  # nothing to create: objects need no directories

    def open_writer(self, name: str) -> FileWriter:
        return PartWriter(self.client, name)

    def list_staging(self) -> dict[str, int]:
        """The files of saves in progress here; never those of the committed checkpoint."""
        return self._staged(self.client.listing())

    def read_staging(self, name: str) -> bytes:
        data = self.client.get(name)
        if data is None:
            raise CorruptCheckpointError(f"{self.url}: staged file {name!r} is missing")
        return data

    def delete_staging_files(self, names: Sequence[str]) -> None:
        protected = set(_PROTOCOL_FILES) | (self._committed_files() or set())
        self.client.delete([n for n in names if n not in protected])

    def commit(self, manifest: bytes, *, overwrite: bool) -> None:
        self._check_guard()
        old = self._committed_files()
        if old is not None and not overwrite:
            raise CheckpointExistsError(
                f"a checkpoint already exists at {self.url} (pass overwrite=True to replace it)"
            )
        # The manifest may replace one left by a crashed attempt, or (overwrite) the
        # committed one: a PUT is atomic, so readers see either manifest whole.
        self.client.put(MANIFEST_NAME, manifest)
        if old is not None:
            self.client.delete(sorted(old - _files_of(manifest, self.url)))
            return
        if not self._write_marker():
            raise CheckpointExistsError(f"a checkpoint appeared at {self.url} during the save")

    def _write_marker(self) -> bool:
        """The commit point: create the empty marker object if absent."""
        return self.client.put(COMMIT_MARKER, b"", create=True)

    def discard_staging(self) -> None:
        """Remove what a failed save wrote (never the committed checkpoint's objects).
        Best effort: the save's own error matters more, and leftovers stay invisible."""
        try:
            stray = [] if self.client.exists(COMMIT_MARKER) else [MANIFEST_NAME]
            self.client.delete(sorted(self._staged(self.client.listing())) + stray)
        except (StorageError, CorruptCheckpointError) as e:
            log.warning("%s: could not remove the files of a failed save: %s", self.url, e)

    # ---- read side ---------------------------------------------------------------------
    def is_committed(self) -> bool:
        return self.client.exists(COMMIT_MARKER)

    def is_retained(self) -> bool:
        return self.client.exists(RETAINED_MARKER)

    def read_manifest(self) -> bytes:
        if not self.client.exists(COMMIT_MARKER):
            names = self.client.listing()
            if any(n == MANIFEST_NAME or n.split("/", 1)[0] in _SAVED_DIRS for n in names):
                why = "only an incomplete save is there (no commit marker)"
            elif names:  # (a directory of checkpoints, say)
                why = "no checkpoint's files are stored at this prefix, only below others"
            else:
                why = "nothing is stored under this prefix"
            raise CheckpointNotFoundError(f"no checkpoint at {self.url}: {why}")
        data = self.client.get(MANIFEST_NAME)
        if data is None:
            raise CorruptCheckpointError(f"{self.url}: committed, but {MANIFEST_NAME} is missing")
        return data

    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        ref = split_ref_name(name)
        if ref is not None:  # a file of a referenced checkpoint beside this one
            self.client.sibling(ref[0]).read_into(ref[1], offset, buffers)
            return
        try:
            self.client.read_into(name, offset, buffers)
        except CorruptCheckpointError:
            # (its marker goes first when it is deleted)
            manifest = self.client.get(MANIFEST_NAME) if self.is_committed() else None
            error = self.missing_file(name, manifest)
            if isinstance(error, CorruptCheckpointError):
                raise  # (the client's own words: what was wrong with the file)
            raise error from None

    def delete(self) -> None:
        """Remove the marker first: from then on the checkpoint does not exist, and a
        delete that stops halfway leaves an incomplete prefix, never a damaged checkpoint."""
        self.client.delete([COMMIT_MARKER])
        self.client.delete(sorted(self.client.listing()))

    def close(self) -> None:
        self.client.close()

    def sibling(self, name: str) -> ObjectStorage:
        """The checkpoint `name` beside this one, through the same store and options."""
        return ObjectStorage(self.url, client=self.client.sibling(name))

    def holds(self, name: str) -> bool:
        """Whether an object `name` exists under the prefix (one HEAD request)."""
        return self.client.exists(name)


def _files_of(manifest: bytes, url: str) -> set[str]:
    """The data and index files a manifest names."""
    m = Manifest.from_json(manifest, f"{url}/{MANIFEST_NAME}")
    records = [m.processes.record_name(q) for q in range(len(m.processes))] if m.processes else []
    own = {f.name for f in m.files if split_ref_name(f.name) is None and f.name}
    return own | set(m.extra.get("indexes", [])) | set(records)


class ObjectRoot(CheckpointRoot):
    """Several checkpoints under one prefix: ``s3://bucket/run`` holds ``run/<name>/…``."""

    def __init__(
        self,
        url: str,
        options: Mapping[str, Any] | None = None,
        *,
        transfer: TransferConfig | None = None,
    ):
        self.client = ObjectClient(url, options, transfer)
        self.url = self.client.url

    @property
    def stats(self) -> RequestStats:
        return self.client.stats

    def list(self) -> dict[str, bool]:
        out: dict[str, bool] = {}
        for rel in self.client.listing():
            name, _, rest = rel.partition("/")
            if not rest or name == LEASE_DIR:
                continue  # an object directly under the root is no checkpoint
            committed = out.get(name, False) or rest == COMMIT_MARKER
            out[name] = committed
        return out

    def child(self, name: str) -> ObjectStorage:
        if not name or "/" in name:
            raise ValueError(f"{self.url}: invalid checkpoint name {name!r}")
        return ObjectStorage(self.client.url, client=self.client.child(name))

    def lease_files(self) -> LeaseFiles:
        return ObjectLeaseFiles(self.client.child(LEASE_DIR))

    def remove_incomplete(self, name: str) -> None:
        if name == LEASE_DIR:
            return
        child = self.child(name).client
        if child.exists(COMMIT_MARKER):
            return
        child.delete(sorted(child.listing()))


class ObjectLeaseFiles(LeaseFiles):
    """The writer lease's documents as objects: creation by a conditional PUT."""

    def __init__(self, client: ObjectClient):
        self.client = client
        self.where = client.url

    def names(self) -> list[str]:
        return [n for n in self.client.listing() if "/" not in n]

    def read(self, name: str) -> bytes | None:
        return self.client.get(name)

    def create(self, name: str, data: bytes) -> bool:
        return self.client.put(name, data, create=True)

    def replace(self, name: str, data: bytes) -> None:
        self.client.put(name, data)

    def remove(self, name: str) -> None:
        self.client.delete([name])
