"""Reading a committed checkpoint's manifest: parsed, validated, and (v2) given lazy chunk
tables. Imports no framework: inspection, the manager and the CLI use it to read metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..gc_pause import collection_paused
from .bases import check_bases
from .finder import ChunkFinder, attach_lazy_tables
from .manifest import Manifest, ManifestSummary
from .validate import validate_structure

if TYPE_CHECKING:
    from ..storage import Storage


def read_summary(storage: Storage) -> ManifestSummary:
    """The manifest's own fields (creation time, bytes, leaf count, `extra`), checked
    against its checksum, its tree and leaves not parsed: what a listing of many steps
    shows of each (CheckpointNotFoundError if none is committed there)."""
    return ManifestSummary.from_json(storage.read_manifest(), storage.url)


def read_manifest(storage: Storage) -> Manifest:
    """The validated manifest of the checkpoint at `storage` (CheckpointNotFoundError if
    none is committed there), with the checkpoints it refers to checked (format.bases).
    v2 chunk tables are fetched only when first used."""
    return read_checkpoint(storage)[0]


@collection_paused()  # the manifest's objects survive the call: see gc_pause.py
def read_checkpoint(storage: Storage) -> tuple[Manifest, ChunkFinder | None]:
    """`read_manifest`, and (v2) the chunk finder its lazy tables fetch records through:
    readers that fetch only the records a box needs use the same one (None: v1)."""
    manifest = Manifest.from_json(storage.read_manifest(), storage.url)
    validate_structure(manifest, storage.url)
    if manifest.version < 2:
        return manifest, None
    if manifest.refs:
        check_bases(storage, manifest)
    return manifest, attach_lazy_tables(storage, manifest)
