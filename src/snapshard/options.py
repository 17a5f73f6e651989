"""The options of a save and of a restore: one object each, shared by every entry point.

`SaveOptions` is taken by snapshard.save and save_async, by snapshard.torch's, and by the
CheckpointManager (for every step it saves); `ReadOptions` by snapshard.load,
snapshard.torch.load, the manager's restore and the safetensors loader. Each field has one
meaning wherever it is passed, and is checked once, when the object is made:

    opts = snapshard.SaveOptions(compression="zstd", writers=2)
    snapshard.save(path, tree, opts)
    mgr = snapshard.CheckpointManager(root, save_options=opts)

What belongs to one call rather than to a policy (the target, `overwrite`, the base of an
incremental save, the `ReadStats` to fill) stays a keyword of that call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .coordination.rendezvous import DEFAULT_TIMEOUT_S
from .format.encoding import COMPRESSIONS
from .planning import MODES

# Host bytes of read buffers held at once while building jax.Arrays.
DEFAULT_MEMORY_BUDGET = 4 << 30


def _whole(name: str, value: object, least: int) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < least
    ):
        raise ValueError(
            f"{name} must be None or a whole number of at least {least}, not {value!r}"
        )


def _seconds(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")


def require(value: object, cls: type, name: str = "options") -> None:
    """Refuse anything but an options object where one is taken (a dict of keywords, the
    other class), naming the argument."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a snapshard.{cls.__name__}, not {type(value).__name__}")


@dataclass(frozen=True)
class SaveOptions:
    """How a save is written.

    mode: the write mode, which process writes which replica's bytes: 'auto' (default),
        'single_replica', 'replica_parallel' or 'balanced' (see planning/write_plan.py).
    writers: data files each process writes in parallel, one thread each. On an object
        store a process's data is cut into more files, each sent in one request
        (TransferConfig.file_bytes), and each writer has several in flight (see
        docs/objstore.md). None (default): chosen per process from the write throughput
        that earlier saves to the same parent location reached (see saving/write_tuning.py).
    compression: None (default), 'zstd', 'zstd+shuffle' or 'zstd-noshuffle'; each checksum
        block is compressed on its own, so reads stay random-access (see format/encoding.py).
    hashes: record each chunk's content hash, so that a later save may use this checkpoint
        as the base of an incremental save (a save with a base always records them).
    host_budget: the host bytes of device-to-host copies made in the blocking phase; the
        slices beyond it are copied by the background phase just before they are written,
        so the caller must not donate or delete those arrays until the save has finished
        (saving/staging.py). None (default): every owned byte is on the host before the blocking
        phase returns. snapshard.torch always copies every byte in the blocking phase.
    timeout_s: how long process 0 waits for every process to report its files written,
        and every process for the outcome of the commit.
    trees_differ: each process's tree may hold keys the others lack (pipeline stages, expert
        groups; torch state dicts): the checkpoint holds their union, and each leaf records
        the processes that saved it. A DTensor is planned among its own mesh's ranks, each
        byte written once; a plain tensor or NumPy array, whose other holders no process
        knows without asking, is written by every rank that passes it, and the commit
        checks the copies equal and keeps one. Every process passes the same value (the
        commit checks). Default False: every process saves the same tree.
    background: where an asynchronous save's background phase runs: 'process', a writer
        process of this process's own, started at its first such save and kept
        (saving/writer_process.py), whose Python work never takes the interpreter from the
        training loop; or 'thread', threads of this process. None (default): the
        environment's SNAPSHARD_BACKGROUND where set, else 'process'. A save that cannot run
        in a writer (a memory:// store, store options that do not pickle, a system with no
        shared memory file) runs in threads, and the log says why, once per reason. Where
        the writer may not read this process's memory (no process_vm_readv, as in gVisor),
        it reads through a shared window instead. With a host budget, the writer asks this
        process for the copies beyond it as it writes them.
    """

    mode: str = "auto"
    writers: int | None = None
    compression: str | None = None
    hashes: bool = False
    host_budget: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    trees_differ: bool = False
    background: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"unknown write mode {self.mode!r}; expected one of {', '.join(MODES)}"
            )
        _whole("writers", self.writers, 1)
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"unknown compression {self.compression!r}; expected one of "
                f"{', '.join(map(repr, COMPRESSIONS))}"
            )
        if not isinstance(self.hashes, bool):
            raise ValueError(f"hashes must be True or False, not {self.hashes!r}")
        _whole("host_budget", self.host_budget, 0)
        _seconds("timeout_s", self.timeout_s)
        if not isinstance(self.trees_differ, bool):
            raise ValueError(f"trees_differ must be True or False, not {self.trees_differ!r}")
        if self.background not in (None, *BACKGROUNDS):
            raise ValueError(f"background must be 'thread' or 'process', not {self.background!r}")


BACKGROUNDS = ("process", "thread")


def background_of(options: SaveOptions) -> str:
    """Where a save's background phase runs (SaveOptions.background, or the environment's
    SNAPSHARD_BACKGROUND, else 'process')."""
    if options.background is not None:
        return options.background
    chosen = os.environ.get("SNAPSHARD_BACKGROUND", "process")
    if chosen not in BACKGROUNDS:
        raise ValueError(f"SNAPSHARD_BACKGROUND must be 'thread' or 'process', not {chosen!r}")
    return chosen


@dataclass(frozen=True)
class ReadOptions:
    """How a restore reads.

    verify: check every byte read against the checksums saved with it (default True).
    threads: read threads per process. None (default): the storage's choice, 4 on object
        stores and for local bytes that must come from the device (each thread keeps one
        request in flight), and on local files whose bytes are in the page cache this
        process's share of its CPUs, at most 4 (those reads are memory copies). The share
        divides the CPUs by `LOCAL_WORLD_SIZE` where the launcher sets it (torchrun does)
        and has not pinned the process to its own cores. Where the bytes are is probed at
        the last byte of the largest reads; a filesystem that cannot tell counts as the
        device.
    memory_budget: host bytes of read buffers held at once (default 4 GiB; None: no
        bound): the buffers jax.Arrays are built from, and those of torch regions that
        cannot be read in place (cast, transposed, on a GPU). NumPy targets are read in
        place.
    max_gap: byte runs of a chunk closer than this are read as one request. None
        (default): the storage's `read_gap_bytes`, 64 KiB on local files, 4 KiB on object
        stores.
    read_once: multi-process restores (JAX and torch): a target replicated across
        processes is read from storage once across the job, each process reading a share,
        and the copies travel over the job's collectives; a target that cuts the saved
        rows (columns split finer than saved) is read as bands of whole rows, once, and
        exchanged. None (default): on for object stores and network filesystems (NFS,
        Lustre, GPFS, gcsfuse... by the mount table), off for the machine's own disks,
        where moving the bytes between processes measured slower than reading them
        again; and there only for arrays of at least READ_ONCE_MIN_BYTES (1 MiB): a
        smaller one costs more to move (a collective each, and for JAX its share of a
        compiled program) than to read again. True: every array it can apply to; False:
        every holder reads its own boxes.
    timeout_s: how long a process waits for the others during a restore (read-once reads,
        the manager's agreement on which tier serves).
    """

    verify: bool = True
    threads: int | None = None
    memory_budget: int | None = DEFAULT_MEMORY_BUDGET
    max_gap: int | None = None
    read_once: bool | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True or False, not {self.verify!r}")
        _whole("threads", self.threads, 1)
        _whole("memory_budget", self.memory_budget, 1)
        _whole("max_gap", self.max_gap, 0)
        if self.read_once is not None and not isinstance(self.read_once, bool):
            raise ValueError(f"read_once must be None, True or False, not {self.read_once!r}")
        _seconds("timeout_s", self.timeout_s)
