"""A torch.distributed (gloo, CPU) rank of the tests of the mistakes and per-rank state users
meet (tests/test_torch_users.py). Every rank runs the same scenarios, in order, and reports
one result per scenario:

    torch_users.py save DIR    per-rank state saved (snapshard.PerProcess of a tensor and of
                               Python values), then the failures: a plain tensor that differs
                               between ranks, a meta tensor on one rank (each rank in turn),
                               an async save onto an existing checkpoint, one rank's writes
                               failing (each in turn), a save into a plain non-empty directory
    torch_users.py load DIR    each rank loads the per-rank state back, into a target and
                               without one; then rank 1 alone loads the whole checkpoint
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from workers._dist import init_torch, leave_torch_job, report

TIMEOUT = 60.0  # what the save's options allow; a failure must come far sooner


def sharded(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    return distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])


def per_rank_state(rank: int, world: int) -> dict[str, Any]:
    import snapshard

    torch.manual_seed(100 + rank)  # every rank's generator is in another state
    return {
        "model": {"w": sharded(world)},
        "rng": snapshard.PerProcess(torch.get_rng_state()),
        "loader": snapshard.PerProcess({"position": 10 + rank, "epoch": 1}),
    }


def attempt(fn: Any) -> dict[str, Any]:
    """Run a save that must fail: its error's type and message, and how long it took."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:
        kinds = [c.__name__ for c in type(e).__mro__ if c.__module__ == "snapshard.errors"]
        return {
            "type": type(e).__name__,
            "kinds": kinds,
            "message": str(e),
            "seconds": time.perf_counter() - t0,
        }
    return {"type": None, "seconds": time.perf_counter() - t0}


class Errors(logging.Handler):
    """The snapshard error lines logged while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def save(root: str, rank: int, world: int) -> dict[str, Any]:
    import snapshard.torch as sst
    from snapshard import SaveOptions

    opts = SaveOptions(timeout_s=TIMEOUT)
    out: dict[str, Any] = {}
    sst.save(f"{root}/per_rank", per_rank_state(rank, world), opts)

    # A plain tensor assumed equal on every rank, that is not: the generator's state.
    torch.manual_seed(rank)
    differ = {"model": {"w": sharded(world)}, "rng": torch.get_rng_state()}
    out["differ"] = attempt(lambda: sst.save(f"{root}/differ", differ, opts))

    # The same keys in another order on rank 1 (a dict built from a set): said so.
    keys = ["a", "b", "c"] if rank == 0 else ["a", "c", "b"]
    ordered = {k: torch.zeros(2) for k in keys}
    out["order"] = attempt(lambda: sst.save(f"{root}/order", ordered, opts))

    # A meta tensor on one rank: that rank fails in its blocking phase, the other in seconds.
    for bad in range(world):
        w = torch.empty(6, 2, device="meta") if rank == bad else torch.zeros(6, 2)
        where = f"{root}/meta{bad}"
        out[f"meta{bad}"] = attempt(lambda w=w, where=where: sst.save(where, {"w": w}, opts))
        # the ranks still agree on the saves to that location: the next one succeeds
        sst.save(where, {"w": torch.zeros(6, 2)}, opts)

    # A synchronous save onto an existing checkpoint that only rank 0 may overwrite: rank 1
    # refuses at once, rank 0 learns it from the rendezvous; the next save is theirs alike.
    where = f"{root}/overwrite"
    sst.save(where, {"w": torch.zeros(6, 2)}, opts)
    ones = {"w": torch.ones(6, 2)}
    out["overwrite"] = attempt(lambda: sst.save(where, ones, opts, overwrite=rank == 0))
    sst.save(where, {"w": torch.full((6, 2), 3.0)}, opts, overwrite=True)
    out["overwrite"]["then"] = sst.load(where)["w"].tolist()

    # A manager whose tree does not flatten on one rank (an object no save takes): the step
    # fails on both, naming the leaf; then ranks that give different steps are told so; the
    # next good step commits and nothing of the failed ones is listed.
    with sst.CheckpointManager(f"{root}/managed", save_options=opts) as mgr:
        bad = {"w": torch.zeros(6, 2), "b": object() if rank == 1 else 1}
        out["manager"] = attempt(lambda: (mgr.save(1, bad), mgr.wait_until_finished()))
        steps = attempt(lambda: (mgr.save(2 + rank, ones), mgr.wait_until_finished()))
        out["manager"]["steps"] = steps["message"]
        mgr.save(4, ones)
        mgr.wait_until_finished()
        out["manager"]["listed"] = mgr.all_steps()

    # An async save onto an existing checkpoint: the same error type on every rank, logged
    # once per rank.
    errors = Errors()
    logging.getLogger("snapshard").addHandler(errors)
    job = sst.save_async(f"{root}/per_rank", per_rank_state(rank, world), opts)
    out["exists"] = attempt(job.wait)
    logging.getLogger("snapshard").removeHandler(errors)
    out["exists"]["logged"] = errors.lines

    # One rank's writing fails (a full disk): both fail, naming it, and nothing is left.
    from snapshard import saving

    write_own = saving.files.write_own
    for bad in range(world):

        def disk_full(prep: Any, bad: int = bad) -> Any:
            if rank != bad:
                return write_own(prep)
            prep.storage.prepare_staging()
            raise OSError(28, f"No space left on device (rank {rank})")

        saving.files.write_own = disk_full
        where = f"{root}/full{bad}"
        out[f"full{bad}"] = attempt(
            lambda where=where: sst.save(where, {"w": sharded(world)}, opts)
        )
    saving.files.write_own = write_own

    # A plain directory that is not a checkpoint.
    if rank == 0:
        os.makedirs(f"{root}/plain")
        with open(f"{root}/plain/notes.txt", "w") as f:
            f.write("not a checkpoint")
    dist.barrier()
    out["plain"] = attempt(lambda: sst.save(f"{root}/plain", {"w": sharded(world)}, opts))
    dist.barrier()
    out["left"] = sorted(p for p in os.listdir(root) if ".snapshard-tmp" in p)
    return out


def load(root: str, rank: int, world: int) -> dict[str, Any]:
    import snapshard.torch as sst
    from snapshard import ReadOptions

    target = per_rank_state(0, world)  # other values, the same structure
    target["rng"] = torch.zeros_like(torch.get_rng_state())
    filled = target["rng"]
    sst.load(f"{root}/per_rank", target)
    whole = sst.load(f"{root}/per_rank")
    alone = None
    if rank == 1:  # one rank looks into a checkpoint by itself: nothing waits for the others
        t0 = time.perf_counter()
        sst.load(f"{root}/per_rank", options=ReadOptions(read_once=True, timeout_s=20))
        alone = time.perf_counter() - t0
    peek = None
    if rank == 0:  # rank 0 alone looks up a value (a launcher's habit): nothing waits, and
        # the loads after it stay paired with the other rank's
        import snapshard

        got = sst.load(f"{root}/per_rank", {"loader": snapshard.PerProcess(None)})
        peek = got["loader"]
    dist.barrier()
    # Rank 1's target has another shape: both ranks fail at once, naming the leaf, and the
    # next load of the location is theirs alike.
    opts = ReadOptions(timeout_s=TIMEOUT)
    bad = {"w": torch.zeros(2, 6) if rank == 1 else torch.zeros(6, 2)}
    refused = attempt(lambda: sst.load(f"{root}/overwrite", bad, opts))
    refused["then"] = sst.load(f"{root}/overwrite", {"w": torch.zeros(6, 2)}, opts)["w"].tolist()
    # Rank 1 cannot open the checkpoint (its credentials refused, or retention deleted the
    # step between the ranks' reads of the manifest): both fail at once, naming it.
    unopened = attempt(lambda: _load_unopened(sst, f"{root}/overwrite", rank, opts))
    unopened["then"] = sst.load(f"{root}/overwrite", {"w": torch.zeros(6, 2)}, opts)["w"].tolist()
    torch.manual_seed(100 + rank)
    want = torch.get_rng_state()
    return {
        "refused": refused,
        "unopened": unopened,
        "rng_in_place": target["rng"] is filled,
        "rng": bool(torch.equal(target["rng"], want)),
        "loader": target["loader"],
        "whole_rng": bool(torch.equal(whole["rng"], want)),
        "whole_loader": whole["loader"],
        "w": whole["model"]["w"].tolist(),
        "alone_s": alone,
        "peek": peek,
    }


def _load_unopened(sst: Any, path: str, rank: int, opts: Any) -> Any:
    """A load into a target whose checkpoint rank 1 cannot open."""
    from snapshard.errors import StorageError
    from snapshard.reading import sources

    opened = sources.open_checkpoint

    def refused(*args: Any) -> Any:
        raise StorageError(f"{path}: access denied (injected on rank {rank})")

    if rank == 1:
        sources.open_checkpoint = refused
    try:
        return sst.load(path, {"w": torch.zeros(6, 2)}, opts)
    finally:
        sources.open_checkpoint = opened


def main() -> None:
    cmd, root = sys.argv[1], sys.argv[2]
    rank, world = init_torch()
    out = save(root, rank, world) if cmd == "save" else load(root, rank, world)
    report(rank=rank, **out)
    leave_torch_job(rank)


if __name__ == "__main__":
    main()
