"""The entry points of the save executor, for every wing: `save` (synchronous),
`save_async` and `AsyncSave`, `save_through` (a wing's own adapter)."""

from __future__ import annotations

import time
from typing import Any

from ..background import BackgroundTask
from ..coordination import Coordinator
from ..gc_pause import Frozen, collection_paused
from ..options import SaveOptions, background_of
from ..storage import Location, Storage
from .blocking import prepare
from .commit import finish_here
from .state import PreparedSave, SaveAdapter, SaveTimings
from .writer_process import finish_in_writer


def save(
    directory: Location | Storage,
    tree: Any,
    options: SaveOptions = SaveOptions(),
    *,
    overwrite: bool = False,
    coordinator: Coordinator | None = None,
    base: Location | Storage | None = None,
) -> SaveTimings:
    """Save `tree` to `directory`, atomically: the checkpoint appears whole or not at all.

    Every process of a multi-process job calls this with the same tree; each writes only the
    slices the shared plan gives it (`options`: the write mode, writers, compression; see
    snapshard.SaveOptions). An existing checkpoint there is an error unless `overwrite`
    (then it is replaced whole, and stays whole until the new one commits); an existing
    empty directory holds nothing to lose and is written into; a directory of other files
    is never replaced.

    With `base` (a committed checkpoint beside this one), chunks whose bytes equal the
    base's chunk of the same box are recorded as references to the file holding them
    instead of being written (see snapshard.saving.incremental); such a save records the chunks'
    content hashes, so that a later save may use it as base in turn.
    """
    return save_through(
        None, directory, tree, options, overwrite=overwrite, coordinator=coordinator, base=base
    )


@collection_paused()
def save_through(
    adapter: SaveAdapter | None,
    directory: Location | Storage,
    tree: Any,
    options: SaveOptions,
    *,
    overwrite: bool,
    coordinator: Coordinator | None,
    base: Location | Storage | None,
) -> SaveTimings:
    """A synchronous save through a framework's adapter (every wing's `save`; None: JAX's)."""
    prep = prepare(
        directory, tree, options, overwrite=overwrite, coordinator=coordinator, base=base,
        adapter=adapter,
    )  # fmt: skip
    return finish(prep)


def finish(prep: PreparedSave) -> SaveTimings:
    """The background phase of every save: in this process's writer process where the save
    is asynchronous and its options say so (SaveOptions.background), else in this thread.
    Raises on this process if the save failed anywhere; the adapter's `release` runs once
    it has ended, however it ended."""
    try:
        if prep.asynchronous and background_of(prep.options) == "process":
            timings = finish_in_writer(prep)  # None: it cannot run there
            if timings is not None:
                return timings
        return finish_here(prep)
    finally:
        prep.adapter.release()
        _let_go(prep.items)
        _let_go(prep.leaves)


def _let_go(objects: list[Any]) -> None:
    """Free a finished save's items or leaves here, a slice at a time: whoever dropped the
    last reference to 10,000 of them at once would hold the interpreter for their
    deallocation (10-30 ms, with their views) in one piece that no thread switch
    interrupts. Every ~2 ms the interpreter is handed over (`time.sleep(0)`): left to the
    switch interval, a training loop waiting for it waited 10-46 ms on 2 busy cores."""
    mark = time.perf_counter()
    while objects:
        del objects[-_FREE_SLICE:]
        if time.perf_counter() - mark > _HOLD_S:
            time.sleep(0)
            mark = time.perf_counter()


_FREE_SLICE, _HOLD_S = 256, 0.002


class AsyncSave(BackgroundTask[SaveTimings]):
    """A save whose background phase is running, for every framework: `wait()` returns its
    timings or raises. Whatever the framework's adapter holds for the save (torch's reused
    host buffers) goes back when it ends, whether it succeeded or not (`finish`)."""

    def __init__(self, prep: PreparedSave):
        self._prep = prep
        # What the blocking phase made (items, views, JAX's shard objects) is kept out of
        # the collections the background phase sets off: gc_pause.py.
        frozen = Frozen()

        def run() -> SaveTimings:
            try:
                return finish(prep)
            finally:
                frozen.release()

        super().__init__(run, f"save to {prep.storage.url}")

    @property
    def location(self) -> str:
        return self._prep.storage.url

    @property
    def timings(self) -> SaveTimings:
        """Per-phase durations; the background ones are filled in when the save is done."""
        return self._prep.timings


def save_async(
    directory: Location | Storage,
    tree: Any,
    options: SaveOptions = SaveOptions(),
    *,
    overwrite: bool = False,
    coordinator: Coordinator | None = None,
    base: Location | Storage | None = None,
    extra: dict[str, Any] | None = None,
) -> AsyncSave:
    """Start a save and return once every owned slice is on the host.

    The caller may then change or donate its arrays (see staging.py for the rule when
    `options.host_budget` is smaller than the bytes this process owns). Writing, syncing,
    merging, validating and committing run in the background. An existing checkpoint at the
    location is detected at commit, without blocking here. `extra`: JSON values stored in
    the manifest beside the tree (the manager keeps its step and metrics there).
    """
    prep = prepare(
        directory, tree, options, overwrite=overwrite, coordinator=coordinator,
        asynchronous=True, extra=extra, base=base,
    )  # fmt: skip
    return AsyncSave(prep)
