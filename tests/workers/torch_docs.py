"""A torch.distributed (gloo, CPU) rank that runs a docs/torch.md example, as the example
asks: on every rank, after the process group is up.

    torch_docs.py SCRIPT DIR   run SCRIPT (the example's code) with DIR as the working
                               directory; report whether it finished
"""

from __future__ import annotations

import os
import runpy
import sys

import torch.distributed as dist

from workers._dist import init_torch, leave_torch_job, report


def main() -> None:
    script, root = sys.argv[1], sys.argv[2]
    rank, _world = init_torch()
    os.chdir(root)
    runpy.run_path(script, run_name="__main__")
    dist.barrier()
    report(rank=rank, done=True)
    leave_torch_job(rank)


if __name__ == "__main__":
    main()
