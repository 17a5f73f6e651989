"""When a restore of several processes reads each byte once (shared by the JAX and PyTorch
read-once paths, and free of either framework)."""

from __future__ import annotations

from typing import NoReturn

from ..coordination.base import Coordinator
from ..coordination.rendezvous import Rendezvous, namespace, on_every_process, same_on_every_process
from ..storage import is_object_store_url
from ..storage.mounts import is_network_filesystem

# By default (read_once=None) an array smaller than this is read by every process that
# holds it: moving it costs a collective (and for JAX its part of the resharding program's
# compilation), some milliseconds per array where reading a few KiB again costs
# microseconds (bench/bench_store_many_arrays.py: 2 processes, 10,000 arrays of 4 KiB
# from the local S3 server, JAX 18.9 s read once against 1.02 s read by every holder).
READ_ONCE_MIN_BYTES = 1 << 20


def too_small(saved_nbytes: int, enabled: bool | None) -> bool:
    """Whether a restore leaves an array out of read-once, to be read by every process
    that holds it: by default (`enabled`, ReadOptions' read_once, None) where it has
    fewer than READ_ONCE_MIN_BYTES; never where read-once was asked for. `saved_nbytes`:
    the array's bytes as saved, what a read fetches whatever the target's dtype (the one
    size floor of the JAX, torch and DCP read-once paths)."""
    return not enabled and saved_nbytes < READ_ONCE_MIN_BYTES


def wanted(location: str, enabled: bool | None, coord: Coordinator, timeout_s: float) -> bool:
    """Whether a restore of several processes whose read-once plan is not empty reads
    once: as `enabled` asks; by default on object stores, and on a network filesystem
    (storage/mounts.py) where every process's mount table says so. There every byte read
    again crosses the network and loads storage the whole job shares; on a disk of the
    machine itself, moving the bytes between processes (CPU collectives over loopback
    here) measured slower than reading them again (see docs/design.md).

    The hosts' mount tables may differ (a file server that also computes sees the path on
    its own disk), and processes that chose differently would wait for each other in the
    read-once agreement: so on a filesystem they agree first (`on_every_process`, one
    report each). Call it only where the plan is not empty: that is the same on every
    process, and a restore without read-once work stays free of coordination."""
    if enabled is not None or is_object_store_url(location):
        return wanted_here(location, enabled)
    rv = Rendezvous(coord, namespace("read-once", location), f"load of {location}", timeout_s)
    return on_every_process(rv, wanted_here(location, enabled))


def wanted_alike(
    location: str,
    enabled: bool | None,
    coord: Coordinator,
    timeout_s: float,
    target: str | None,
    error: BaseException | None = None,
) -> bool:
    """`wanted`, for a restore whose processes' targets may differ (torch state dicts of a
    job whose ranks hold different keys: pipeline stages, expert groups): read-once only
    where every process wants it and every process's target has the same digest
    (`target`), since the read-once plans are made by each process from its own target
    alone. One report each, on object stores too. `error`: this process's target was
    refused (raised on every process, naming it, rather than left for the others to wait
    for until their timeout)."""
    rv = Rendezvous(coord, namespace("read-once", location), f"load of {location}", timeout_s)
    mine = target if target is not None and wanted_here(location, enabled) else None
    return same_on_every_process(rv, mine, error)


def wanted_here(location: str, enabled: bool | None) -> bool:
    """This process's own view of `wanted`, before the processes agree: for a caller whose
    reports already travel together (DCP's local plans), which then reads once only where
    every process said yes."""
    if enabled is not None:
        return enabled
    if is_object_store_url(location):
        return True
    try:
        return is_network_filesystem(location)
    except Exception:  # this process must still report, or the others wait for it
        return False


def refuse_target(
    location: str, enabled: bool | None, coord: Coordinator, timeout_s: float, error: BaseException
) -> NoReturn:
    """This process's target was refused (`error`, raised here) before its load's read-once
    exchange (`wanted_alike`), which every process of a multi-process load enters unless
    read-once is off (`enabled` False): the others learn it there and raise it too, naming
    this process, instead of waiting for its report until their timeout (and every later
    load of the location staying paired with the next one of this process)."""
    if coord.process_count > 1 and enabled is not False:
        wanted_alike(location, enabled, coord, timeout_s, None, error)
    raise error
