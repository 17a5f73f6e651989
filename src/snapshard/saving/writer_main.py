"""The writer process's side of a background phase run out of the training process
(SaveOptions.background="process"): its loop (`serve`), the save rebuilt from each message
(`prepared`), its calls on the training process's coordinator. The protocol is
writer_protocol.py's; the training process's side is writer_process.py.

The writer imports no framework: NumPy, the format and the storage (a local filesystem, or an
object store whose client the writer makes again from its URL and options, once). It ends
when the socket closes (its training process ended or let it go) and is killed with it
otherwise.
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import sys
import warnings
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..coordination.base import Coordinator
from ..coordination.rendezvous import Rendezvous
from .save_array import SaveArray
from .staging import StagedItem
from .state import PreparedSave
from .writer_protocol import Link, Message, Template, portable_error, portable_warnings
from .writer_reads import RemoteBytes, StagedLater, Window, WindowBytes, read_remote, read_words

_NICE = 5  # a third of a CPU's share beside a busy process: below the loop, never starved


class ProxyCoordinator(Coordinator):
    """The training process's coordinator, reached through the link (which takes one call
    at a time)."""

    def __init__(self, link: Link, process_index: int, process_count: int):
        self._link = link
        self.process_index = process_index
        self.process_count = process_count

    def set(self, key: str, value: str) -> None:
        self._link.call("set", key, value)

    def get(self, key: str, timeout_s: float) -> str:
        return str(self._link.call("get", key, timeout_s))

    def try_get(self, key: str) -> str | None:
        value = self._link.call("try_get", key)
        return None if value is None else str(value)

    def barrier(self, name: str, timeout_s: float) -> None:
        self._link.call("barrier", name, timeout_s)

    def get_dir(self, prefix: str) -> dict[str, str]:
        return dict(self._link.call("get_dir", prefix))

    def delete(self, prefix: str, keys: Any = None) -> None:
        self._link.call("delete", prefix, None if keys is None else list(keys))

    def increment(self, key: str, by: int = 1) -> int:
        return int(self._link.call("increment", key, by))

    def set_if_absent(self, key: str, value: str) -> str:
        return str(self._link.call("set_if_absent", key, value))


class _NoAdapter:
    """The adapter of a save run in the writer: every layout was described and every item
    staged by the training process, whose adapter releases what it lent when the save ends."""

    trees_differ = False

    def mesh_of(self, arr: SaveArray) -> None:
        raise AssertionError(f"leaf {arr.name!r}: its layout was not described before sending")

    def release(self) -> None:
        return None


def prepared(
    msg: Message, template: Template, link: Link, parent: int, window: Window | None
) -> PreparedSave:
    """The PreparedSave that `finish` runs on, rebuilt in the writer from `msg`, its items
    read from the training process's memory, or through `window`."""
    from .blocking import plan_save

    leaves = list(template.leaves)
    for i, value in msg.values:
        leaves[i] = value
    arrays = [x for x in leaves if isinstance(x, SaveArray)]
    prefix, what, timeout_s, index, count = msg.rendezvous
    rv = Rendezvous(ProxyCoordinator(link, index, count), prefix, what, timeout_s)
    plan = plan_save(arrays, msg.options, count)
    of_leaf, starts, stops, nbytes, addresses, later = msg.items
    if msg.data_offset is not None:  # (never through a window: sent as None)
        now = ~later
        addresses = addresses.copy()
        addresses[now] = read_words(
            parent, addresses[now].astype(np.uint64) + np.uint64(msg.data_offset)
        )
    items = []
    columns = zip(
        of_leaf.tolist(), nbytes.tolist(), addresses.tolist(), later.tolist(), strict=True
    )
    for j, (i, n, a, staged_later) in enumerate(columns):
        arr = leaves[i]
        assert isinstance(arr, SaveArray)
        start, stop = starts[j], stops[j]
        shape = tuple((stop - start).tolist())
        deferred: RemoteBytes | WindowBytes | StagedLater
        if window is not None:  # (the training process stages an item staged later itself)
            deferred = WindowBytes(window, j, arr.dtype, shape, staged_later)
        else:
            remote = RemoteBytes(parent, a, arr.dtype, shape)
            deferred = StagedLater(link, j, remote) if staged_later else remote
        items.append(StagedItem(i, arr.name, start, stop, n, deferred=deferred))
    storage = msg.storage
    if msg.guarded:
        storage.commit_guard = lambda: link.call("guard")
    adapter = _NoAdapter()
    adapter.trees_differ = msg.options.trees_differ
    return PreparedSave(
        storage, rv, leaves, template.structure, plan, items, msg.overwrite, msg.options,
        msg.extra, msg.digests, msg.timings, msg.increment, nonce=msg.nonce,
        adapter=adapter, copies=msg.copies,  # type: ignore[arg-type]
    )  # fmt: skip


def serve(conn: Connection, parent: int, window_fd: int = -1) -> None:
    """The writer's loop: saves one after the other until the socket closes."""
    from .commit import finish_here

    link = Link(conn)
    templates: dict[int, Template] = {}
    window: Window | None = None
    while True:
        try:
            msg = link.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "probe":
            _, address, n, expected, window_only = msg
            why = "asked to" if window_only else _unreadable(parent, address, n, expected)
            answer: tuple[str, Any] = ("ready", None)
            if why is not None and window_fd < 0:
                answer = ("unable", why)
            elif why is not None:
                view = np.frombuffer(mmap.mmap(window_fd, 0), np.uint8)
                window = Window(link, view)
                answer = ("window", why)
            try:
                link.send(*answer)
            except OSError:  # the training process is gone (killed as its writer started)
                return
        elif kind == "template":
            template = msg[1]
            templates = {template.number: template}  # one state at a time: the newest
        elif kind == "save":
            save: Message = msg[1]
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")  # the training process's filters decide
                try:
                    prep = prepared(save, templates[save.template], link, parent, window)
                    outcome: tuple[str, Any] = ("done", finish_here(prep))
                except BaseException as e:  # every failure goes back to the training process
                    outcome = ("failed", portable_error(e))
                finally:
                    save.storage.close()
            try:
                link.send(*outcome, save.storage.requests_made(), portable_warnings(warned))
            except OSError:  # the training process is gone: so is the save
                return


def _unreadable(parent: int, address: int, n: int, expected: bytes) -> str | None:
    """Why the writer cannot read `parent`'s memory (the probe's bytes there), or None."""
    out = np.empty(n, np.uint8)
    try:
        read_remote(parent, address, out)
    except OSError as e:
        return str(e)
    return None if out.tobytes() == expected else "the bytes read differ"


def main() -> None:
    # Below the training process in the CPU's scheduling: where the cores are all busy,
    # the loop goes first and the save drains in what it leaves.
    os.nice(_NICE)
    # It ends when its training process lets it go (the socket closes), never on a signal
    # sent to the whole job (Ctrl-C, a scheduler's SIGTERM): the save in flight finishes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, window_fd = int(sys.argv[-2]), int(sys.argv[-1])
    sock = socket.socket(fileno=fd)
    conn = Connection(os.dup(sock.fileno()))
    sock.close()
    serve(conn, os.getppid(), window_fd)
