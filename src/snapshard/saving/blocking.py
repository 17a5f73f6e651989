"""The blocking phase of a save: flatten, plan (zero-RPC; per holder set where the trees
differ), stage this process's items on the host through the wing's adapter. Nothing else."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import numpy as np

from ..coordination import Coordinator, default_coordinator
from ..coordination.rendezvous import (
    Rendezvous,
    namespace,
    report_failure,
)
from ..errors import (
    CheckpointExistsError,
    SnapshardError,
)
from ..format import (
    compression,
)
from ..frameworks import default_save_adapter
from ..gc_pause import collection_paused
from ..options import SaveOptions, background_of, require
from ..planning import WritePlan, plan_writes
from ..planning.write_plan import plan_by_holders
from ..storage import Location, Storage, storage_for
from ..tree import FlatTree, flatten
from . import copies
from .incremental import Increment
from .leaves import classify_leaves, leaf_digests, path_json
from .save_array import SaveArray
from .staging import Snapshot
from .state import PreparedSave, SaveAdapter, SaveTimings

# Where the saves started in this context are counted for their rendezvous' name, in place of
# their own locations (saves_counted_under).
_counted_under: ContextVar[str | None] = ContextVar("snapshard_saves_counted_under", default=None)


@contextlib.contextmanager
def saves_counted_under(location: str) -> Iterator[None]:
    """Saves started inside name their rendezvous as the n-th save under `location` (a
    CheckpointManager's directory, whose every process makes its saves in the same order),
    not as the n-th save to their own location. The process keeps a count for every location
    it names an operation after (coordination/rendezvous.namespace), for as long as it runs:
    a manager saves each step to a location of its own, and one count per step saved would
    grow with every save."""
    token = _counted_under.set(location)
    try:
        yield
    finally:
        _counted_under.reset(token)


def plan_save(arrays: list[SaveArray], options: SaveOptions, process_count: int) -> WritePlan:
    """The write plan of a save's arrays: pure, from their layouts alone (a writer process
    makes it again from the same leaves)."""
    layouts = [a.layout for a in arrays]
    if options.trees_differ:  # each holder set planned on its own, alike on each of its holders
        keys = [path_json(a.path) for a in arrays]
        return plan_by_holders(layouts, keys, options.mode, num_processes=process_count)
    return plan_writes(layouts, options.mode, num_processes=process_count)


def refuse_existing(storage: Storage, overwrite: bool) -> None:
    """A synchronous save's early refusal of an existing checkpoint, before any work (the
    commit checks again, atomically)."""
    if not overwrite and storage.is_committed():
        raise CheckpointExistsError(
            f"a checkpoint already exists at {storage.url} (pass overwrite=True to replace it)"
        )


@collection_paused(transient=True)  # what it leaves alive is the save's, freed when it ends
def prepare(
    location: Location | Storage,
    tree: Any,
    options: SaveOptions = SaveOptions(),
    *,
    overwrite: bool = False,
    coordinator: Coordinator | None = None,
    asynchronous: bool = False,
    extra: dict[str, Any] | None = None,
    snapshot: Snapshot | None = None,
    flat: FlatTree | None = None,
    adapter: SaveAdapter | None = None,
    base: Location | Storage | None = None,
    identical: frozenset[int] = frozenset(),
) -> PreparedSave:
    """The blocking phase: plan, then bring every owned slice to host memory through
    `adapter`, the framework's wing (None: JAX's, which stages from `snapshot`, the host copy
    of the tree's device arrays, when one was already made; other adapters ignore it).
    `asynchronous`: the caller goes on before `finish` writes the bytes (save_async, the
    manager), so staging must not depend on the tree staying as it is (staging.stage)."""
    t0 = time.perf_counter()
    require(options, SaveOptions)
    background_of(options)  # a bad SNAPSHARD_BACKGROUND fails here, before any work
    if adapter is None:
        adapter = default_save_adapter(options.host_budget, snapshot)
    coord = coordinator or default_coordinator()
    storage = storage_for(location)
    rv = _rendezvous(storage, coord, options.timeout_s)
    try:
        return _prepare(
            rv, storage, tree, options, overwrite=overwrite, asynchronous=asynchronous,
            extra=extra, flat=flat, adapter=adapter, base=base, identical=identical, t0=t0,
        )  # fmt: skip
    except BaseException as e:
        _reported(rv, storage, e)
        raise


def _rendezvous(storage: Storage, coord: Coordinator, timeout_s: float) -> Rendezvous:
    """The save's rendezvous. Its namespace is taken in program order, the same on every
    process: a save that fails on one process must still take it (`failed_before`), or
    every later save of that location pairs with another process's next one."""
    name = namespace("save", _counted_under.get() or storage.url)
    return Rendezvous(coord, name, f"save to {storage.url}", timeout_s)


def _reported(rv: Rendezvous, storage: Storage, error: BaseException) -> None:
    """This process's blocking phase failed: the others fail at once, naming `error`;
    where process 0 failed the save first, its error (the cause) is raised instead."""
    cause = report_failure(rv, error)
    if cause is not None:
        storage.discard_staging_if_empty()
        raise cause from error


def failed_before(
    location: Storage, error: BaseException, coordinator: Coordinator, timeout_s: float
) -> None:
    """A save of `location` that failed on this process before `prepare` (a manager's tree
    that does not flatten): reported as `prepare` reports its own failures."""
    _reported(_rendezvous(location, coordinator, timeout_s), location, error)


def _prepare(
    rv: Rendezvous,
    storage: Storage,
    tree: Any,
    options: SaveOptions,
    *,
    overwrite: bool,
    asynchronous: bool,
    extra: dict[str, Any] | None,
    flat: FlatTree | None,
    adapter: SaveAdapter,
    base: Location | Storage | None,
    identical: frozenset[int],
    t0: float,
) -> PreparedSave:
    coord = rv.coord
    # Staging named after the job and the save's number: saves of two jobs to one location
    # never share it, and a failed save's clean-up never meets the files of the next one.
    storage.set_attempt(f"{coord.job_token()}-{rv.prefix.rpartition('/')[2]}")
    if not asynchronous:  # (an asynchronous save is not held up by asking: the commit tells)
        refuse_existing(storage, overwrite)
    if options.compression is not None and not compression.available():
        raise SnapshardError("compression needs zstd: install snapshard[compress]")
    if options.trees_differ != adapter.trees_differ:
        raise ValueError(
            "SaveOptions(trees_differ=True) saves torch state dicts that differ by rank "
            "(snapshard.torch); a JAX tree is global: an array on a sub-mesh is saved by the "
            "processes of its devices as it is"
        )
    if options.trees_differ and (base is not None or options.hashes):
        raise ValueError(
            "a save of differing trees (SaveOptions.trees_differ) cannot be incremental yet"
        )
    increment = None
    if base is not None or options.hashes:
        increment = Increment(base, storage, identical)
    flat = flat or flatten(tree, adapter.is_leaf)
    leaves = classify_leaves(flat, coord.process_count, adapter)
    arrays = [(i, leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, SaveArray)]
    plan = plan_save([a for _, a in arrays], options, coord.process_count)
    t1 = time.perf_counter()
    items, copied = adapter.stage(arrays, plan, coord.process_index, copy=asynchronous)
    # Host values are assumed equal on every process: their digests are compared at commit.
    digests = leaf_digests(leaves, values=coord.process_count > 1)
    at = np.zeros(0, np.int64)
    if coord.process_count > 1 and not options.trees_differ:
        at = copies.copy_leaves(leaves)
        copies.put_fingerprints(leaves, digests, at)
    storage.prepare_staging()  # from now on a load of the location can tell a save runs
    t2 = time.perf_counter()
    timings = SaveTimings(plan_s=t1 - t0, stage_s=t2 - t1, blocking_s=t2 - t0, bytes_staged=copied)
    return PreparedSave(
        storage, rv, leaves, flat.structure, plan, items, overwrite, options, extra or {},
        digests, timings, increment, adapter=adapter, asynchronous=asynchronous, copies=at,
    )  # fmt: skip
