"""The CPUs this process may use, and its share of them among the job's processes on this
machine (which split the machine's cores between them)."""

from __future__ import annotations

import os


def usable() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_processes() -> int:
    """The job's processes on this machine: `LOCAL_WORLD_SIZE` where the launcher sets it
    (torchrun and torchelastic do), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def share() -> int:
    """This process's share of the CPUs, at least 1: the CPUs it may use, divided among the
    local processes when it may use the whole machine (a launcher that pins each process
    to its own cores has divided them already)."""
    n = usable()
    if n < (os.cpu_count() or n):
        return n
    return max(1, n // local_processes())
