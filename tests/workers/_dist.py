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


def torch_launch_env() -> None:
    """The job's layout as torchrun would set it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), for libraries that read it themselves (Accelerate)."""
    rank = os.environ["SNAPSHARD_TEST_PROCESS_ID"]
    os.environ.update(
        RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=os.environ["SNAPSHARD_TEST_NUM_PROCESSES"],
        MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["SNAPSHARD_TEST_PORT"],
    )  # fmt: skip


def report(**values: object) -> None:
    print("RESULT " + json.dumps(values), flush=True)
    sys.stdout.flush()


def exit_after_failure(code: int) -> None:
    """Leave a jax.distributed job whose operation failed, skipping JAX's shutdown barrier
    (with the operation failed it may never complete). Process 0 hosts the coordination
    service: when it goes, the other processes' JAX clients abort them, so it leaves only
    once every other process has exited (its pid gone, or a zombie waiting to be reaped).
    For failures that every process lives through (a process that died never reports)."""
    import os
    import time

    from snapshard.coordination import default_coordinator

    coord = default_coordinator()
    pid = coord.process_index
    coord.set(f"test/exiting/{pid}", str(os.getpid()))
    if pid == 0:
        pids = [int(coord.get(f"test/exiting/{q}", 30)) for q in range(1, coord.process_count)]
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(code)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def failing_torch_load(rank: int, fail_rank: int, load) -> None:
    """Run `load()` on every rank with `fail_rank`'s storage reads failing; report the
    outcome and exit. Rank 0 hosts the store: it stays until every rank has seen the
    outcome. The process group's shutdown is skipped (a failed load leaves no collective
    to finish)."""
    import time

    if rank == fail_rank:
        from snapshard.storage import local

        def read_into(self, name, offset, buffers):
            raise OSError(5, f"injected read failure on rank {rank}")

        local.LocalStorage.read_into = read_into
    t0 = time.perf_counter()
    try:
        load()
        report(rank=rank, error=None)
    except Exception as e:
        report(rank=rank, error=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
    leave_torch_job(rank)


def report_torch_results(rank: int, want: dict, **result: object) -> None:
    """Report a torch rank's results with the unique bytes of the saved state `want`, then
    exit once every rank has reported. As in `failing_torch_load`, torch's teardown is
    skipped: under load it sometimes aborted a rank at exit ("terminate called without an
    active exception"), after its results were in."""
    import torch.distributed as dist

    unique = sum(v.numel() * v.element_size() for v in want.values())
    dist.barrier()
    report(rank=rank, unique=unique, **result)
    leave_torch_job(rank)


def leave_torch_job(rank: int) -> None:
    """Exit a torch rank whose results are reported, without torch's teardown (under load
    it sometimes aborted a rank at exit, "terminate called without an active exception").
    Rank 0 hosts the store: it stays until every rank has come here."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/reported/{rank}", "1")
    if rank == 0:
        world = dist.get_world_size()
        store.wait([f"test/reported/{q}" for q in range(world)], timedelta(seconds=30))
    os._exit(0)
