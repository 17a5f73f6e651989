"""Worker side of tests/multiproc.py: join the job and report results."""

from __future__ import annotations

import json
import os
import sys


def init() -> tuple[int, int]:
    """Initialise jax.distributed from the environment set by the test; returns (pid, n)."""
    import jax

    pid = int(os.environ["SNAPSHARD_TEST_PROCESS_ID"])
    n = int(os.environ["SNAPSHARD_TEST_NUM_PROCESSES"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{os.environ['SNAPSHARD_TEST_PORT']}",
        num_processes=n,
        process_id=pid,
        initialization_timeout=60,
        heartbeat_timeout_seconds=int(os.environ.get("SNAPSHARD_TEST_HEARTBEAT_S", "10")),
    )
    return pid, n


def init_torch() -> tuple[int, int]:
    """Join the torch.distributed (gloo) job the test started; returns (rank, world size)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank = int(os.environ["SNAPSHARD_TEST_PROCESS_ID"])
    world = int(os.environ["SNAPSHARD_TEST_NUM_PROCESSES"])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['SNAPSHARD_TEST_PORT']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    return rank, world


def report(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)
    sys.stdout.flush()
