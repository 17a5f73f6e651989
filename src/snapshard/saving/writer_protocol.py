"""The protocol between a training process and its writer process (SaveOptions.background=
"process"): its messages and the link that carries them. The training process's side is
writer_process.py, the writer's writer_main.py.

The writer is started once per training process as `python -c "...writer_main import
main; main()" FD WINDOW`, with FD one end of a socket pair and WINDOW a shared memory file
(memfd) of the training process's, or -1. The protocol, in order, each message a pickled
tuple:

1. the training process sends ("probe", address, nbytes, expected, window_only); the
   writer reads those bytes out of the training process's memory (its parent's)
   (`process_vm_readv`) and answers ("ready", None); where it cannot (a kernel or a sandbox
   that forbids or lacks the call) or is told not to (`window_only`), it answers
   ("window", why) and reads every staged item through the shared window instead (below),
   or ("unable", why) where there is no window: the training process then keeps its
   background phase in threads;
2. ("template", Template) whenever the tree changed (its leaves, without their values);
   then per save, ("save", Message): where each staged item's bytes are in the training
   process's memory, the values of the leaves that are not arrays, the save's storage and
   rendezvous. The writer runs the whole background phase (saving.commit.finish_here: data
   files, records, process 0's commit);
3. while it runs, each call on the coordinator or the storage's commit guard goes to the
   training process as ("call", method, args) and waits for ("reply", value) or
   ("raise", error): the key-value store of a job is the training process's;
   Through a window, reading staged bytes is such a call too: ("call", "copy", (rows,))
   with rows of (item, byte offset, nbytes, window offset), which the training process
   answers once it has copied those bytes of its items into the window
   (writer_reads.Window); and an item the host budget left without a host copy
   (SaveOptions.host_budget) is asked for as it is written: ("call", "stage", (item,))
   makes its copy and answers its address, then its bytes are read as any other item's,
   then ("call", "unstage", (item,)) lets the copy go (writer_reads.StagedLater); through
   a window, the copy call stages such an item itself and lets it go once all its bytes
   went through;
4. the save ends with ("done", timings, made, warned) or ("failed", error, made, warned),
   the error pickled with its type (errors.py: every snapshard error crosses processes by
   pickle), `made` what the writer's copy of the storage counted of its requests (an
   object store's), which the training process's copy adds to its own, and `warned` the
   warnings the save raised in the writer (category, text), which the training process raises
   again (an incremental save's base that cannot prove its chunks equal says so).
"""

from __future__ import annotations

import pickle
import threading
import warnings
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ..errors import SnapshardError
from ..format import Leaf
from ..options import SaveOptions
from ..storage import Storage
from .incremental import Increment
from .save_array import SaveArray
from .state import SaveTimings


@dataclass
class Message:
    """One save, as the training process sends it to its writer (see the module's doc)."""

    template: int  # the template's number: its leaves and structure, sent once (`Template`)
    values: list[tuple[int, Leaf]]  # the leaves that are not arrays, this save's values
    digests: np.ndarray
    items: tuple[np.ndarray, list[np.ndarray], list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]
    # (leaf, start, stop, nbytes, where, later) of each staged item, as columns; where: the
    # address of its bytes, or with `data_offset` the address of its ndarray object, which
    # holds the address of its bytes `data_offset` bytes in; later: its host copy is made
    # only when the writer asks for it (writer_reads.StagedLater), where 0
    data_offset: int | None
    storage: Storage
    guarded: bool  # the storage has a commit guard, which runs in the training process
    rendezvous: tuple[str, str, float, int, int]  # prefix, what, timeout, process, count
    overwrite: bool
    options: SaveOptions
    extra: dict[str, Any]
    nonce: str
    timings: SaveTimings
    increment: Increment | None  # an incremental save's base and target (not yet opened)
    copies: np.ndarray  # PreparedSave.copies


@dataclass
class Template:
    """What stays the same from one save of a state to the next: its leaves (arrays without
    their values; see SaveArray.__getstate__) and the tree's structure."""

    number: int
    leaves: list[Leaf | SaveArray]
    structure: dict[str, Any]


class Link:
    """One end of the socket: pickled tuples each way (both processes frame them so), and
    the writer's calls into the training process."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._calls = threading.Lock()  # a call and its reply, one thread at a time

    def send(self, *msg: Any) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=5))

    def recv(self) -> tuple[Any, ...]:
        return tuple(pickle.loads(self.conn.recv_bytes()))

    def call(self, method: str, *args: Any) -> Any:
        with self._calls:
            self.send("call", method, args)
            kind, value = self.recv()
        if kind == "raise":
            raise value
        return value


def portable_warnings(caught: list[warnings.WarningMessage]) -> list[tuple[type[Warning], str]]:
    """The warnings a save raised here, as (category, text) for the training process to
    raise again: a category that does not pickle goes as a UserWarning."""
    out = []
    for w in caught:
        category = w.category
        try:
            pickle.dumps(category)
        except Exception:
            category = UserWarning
        out.append((category, str(w.message)))
    return out


def portable_error(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a SnapshardError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return SnapshardError(f"{type(e).__name__}: {e}")
