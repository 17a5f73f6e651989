"""A torch.distributed (gloo, CPU) rank that runs a docs/torch.md example, as the example
asks: on every rank, after the process group is up.

    torch_docs.py SCRIPT DIR   run SCRIPT (the example's code) with DIR as the working
                               directory; report whether it finished
"""

from __future__ import annotations

import os
import runpy
import sys
from datetime import timedelta

import torch.distributed as dist

from workers._dist import init_torch, report


def main() -> None:
    script, root = sys.argv[1], sys.argv[2]
    rank, world = init_torch()
    os.chdir(root)
    runpy.run_path(script, run_name="__main__")
    dist.barrier()
    report(rank=rank, done=True)
    # Rank 0 hosts the store: it stays until every rank has reported (torch's teardown is
    # skipped, see workers._dist.report_torch_results).
    store = dist.distributed_c10d._get_default_store()
    store.set(f"test/reported/{rank}", "1")
    if rank == 0:
        store.wait([f"test/reported/{q}" for q in range(world)], timedelta(seconds=30))
    os._exit(0)


if __name__ == "__main__":
    main()
