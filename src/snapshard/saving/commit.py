"""The background phase's end: process 0 checks the reports, builds the manifest,
validates it, checks the staged files and commits; every process learns the outcome, and a
failed save leaves nothing of its own behind."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..coordination.rendezvous import (
    write_then_commit,
)
from ..errors import (
    CoordinationError,
    SnapshardError,
)
from ..format import (
    Manifest,
    ProcessTable,
    records,
    validate_structure,
)
from ..format.files import ProcessReport
from ..format.leaves import PerProcessLeaf
from ..format.naming import values_file_name
from ..storage import Storage
from ..storage.owner_records import is_owner_record
from . import files
from .agreement import check_agreement, check_same_save, named_by_us, read_union
from .copies import check_copies
from .incremental import check_refs_committed, manifest_refs
from .leaves import describe_leaves
from .state import PreparedSave, SaveTimings

log = logging.getLogger("snapshard")


def commit_save(prep: PreparedSave, docs: list[dict[str, Any]]) -> None:
    """Process 0: check the reports (`docs`, each a ProcessReport's JSON) against the plan
    and the staged files, write the manifest, commit. O(processes): no process's records
    are read."""
    url = prep.storage.url
    reports = [ProcessReport.from_json(d) for d in docs]
    check_same_save(prep, reports)
    union = read_union(prep, reports) if prep.options.trees_differ else None
    if union is None:
        check_agreement(prep, reports)
        check_copies(prep, reports, prep.copies)
    table = ProcessTable(
        nonces=[r.nonce for r in reports],
        data_sizes=[list(r.sizes) for r in reports],
        record_sizes=[r.record_size for r in reports],
        record_crcs=[r.record_crc for r in reports],
    )
    if union is None:
        structure, (leaves, meshes, layouts) = prep.structure, describe_leaves(prep)
    else:
        structure, leaves = union.structure, union.leaves
        meshes, layouts, table.leaf_map = union.meshes, union.layouts, union.leaf_map
    if any(isinstance(leaf, PerProcessLeaf) for leaf in leaves):
        table.values_sizes = [r.values_size for r in reports]
        table.values_crcs = [r.values_crc for r in reports]
    manifest = Manifest.of_processes(
        table, structure, leaves, write_mode=prep.plan.mode, layouts=layouts, meshes=meshes,
        extra=prep.extra,
    )  # fmt: skip
    expected = staged_files(table)
    # Bytes stored = each array's bytes plus its checksums: the tiling, from the sizes alone.
    # (the plans of differing trees are each process's own: each reports its planned bytes)
    if union is not None:
        planned = sum(r.planned_bytes for r in reports)
    else:
        planned = int(prep.plan.bytes_per_process().sum()) if prep.plan.arrays else 0
    planned -= sum(r.referenced_bytes + r.packed_saved for r in reports)
    stored = sum(f.size for f in manifest.files)
    if stored < planned:
        raise CoordinationError(
            f"save to {url}: the data files hold {stored} bytes, the plan {planned}"
        )
    if prep.increment is not None and prep.increment.base is not None:
        manifest.refs = manifest_refs(prep.increment.base, docs)
        manifest.files = manifest.files + check_refs_committed(prep.storage, manifest.refs)
    used = {c for r in reports for c in (*r.codecs, *r.ref_codecs)}
    manifest.codecs = [records.CODECS[c] for c in sorted(used)]
    commit_manifest(prep.storage, manifest, expected, overwrite=prep.overwrite)


def staged_files(table: ProcessTable) -> dict[str, int]:
    """Every file the processes of a save staged (data, records, values), with its size."""
    expected = {f.name: f.size for f in table.files()}
    expected.update({table.record_name(q): size for q, size in enumerate(table.record_sizes)})
    expected.update(
        {
            values_file_name(q, n): size
            for q, (n, size) in enumerate(zip(table.nonces, table.values_sizes, strict=False))
            if size  # (0: where trees differ, a process that saved no per-process values)
        }
    )
    return expected


def commit_manifest(
    storage: Storage, manifest: Manifest, expected: dict[str, int], *, overwrite: bool
) -> None:
    """The last step of every save: the manifest validated, the staged files exactly
    `expected` (name: size), then the storage's commit (rename, or marker written last)."""
    validate_structure(manifest, storage.url)
    check_staged_files(storage, expected)
    storage.commit(manifest.to_json(), overwrite=overwrite)


def check_staged_files(storage: Storage, expected: dict[str, int]) -> None:
    """Files on storage are exactly those of this save, with the sizes reported.

    Files of an earlier attempt that died (other nonces) are removed first, and the
    writers' owner records (storage/owner_records.py), which are no part of a checkpoint.
    """
    listing = storage.list_staging()
    records = [n for n in listing if is_owner_record(n)]
    stale = [n for n in listing if n not in expected and not is_owner_record(n)]
    if stale:
        log.warning(
            "save to %s: removing %d stale file(s) of an earlier attempt", storage.url, len(stale)
        )
        storage.delete_staging_files(stale)
    if records:
        storage.delete_staging_files(records)
    for name, size in expected.items():
        if listing.get(name) != size:
            raise CoordinationError(
                f"save to {storage.url}: file {name!r} has {listing.get(name)} bytes on storage, its process reported {size}"
            )


def discard_own(prep: PreparedSave, settled: bool) -> None:
    """The files this process staged for a save that failed, removed (process 0 removes
    the staging area; this process's files may come after that), and once process 0 has
    failed the save (`settled`), the staging area if that leaves it empty. Never another
    process's files, which may still be in the making. Best effort: the save's own error
    is what the caller must see."""
    try:  # (settled: process 0 writes no more, so the last process to leave removes it)
        remove_own(prep.storage, prep.rendezvous.coord.process_index, prep.nonce, settled)
    except SnapshardError as e:
        log.warning("%s: could not remove this process's files: %s", prep.rendezvous.what, e)


def remove_own(storage: Storage, pid: int, nonce: str, settled: bool) -> None:
    """Process `pid`'s staged files of the save of `nonce` removed, and where `settled`, the
    staging area if that leaves it empty."""
    mine = f"p{pid:05d}-{nonce}"
    storage.delete_staging_files(
        [n for n in storage.list_staging() if n.rpartition("/")[2].startswith(mine)]
    )
    if settled:
        storage.discard_staging_if_empty()


def finish_here(prep: PreparedSave) -> SaveTimings:
    """The background phase in this process's threads (entry.finish; a writer process runs
    it so too). Raises on this process if the save failed anywhere."""
    t0 = time.perf_counter()
    t1 = t0

    def write() -> dict[str, Any]:
        nonlocal t1
        report = files.write_own(prep)
        t1 = time.perf_counter()
        prep.timings.write_s = t1 - t0
        return report

    try:
        write_then_commit(
            prep.rendezvous, write, lambda reports: commit_save(prep, reports),
            prep.storage.discard_staging, lambda settled: discard_own(prep, settled),
        )  # fmt: skip
    except CoordinationError as e:
        named = named_by_us(prep, e)
        if named is None:
            raise
        raise named from e
    t2 = time.perf_counter()
    prep.timings.commit_s = t2 - t1
    prep.timings.total_s = prep.timings.blocking_s + (t2 - t0)
    return prep.timings
