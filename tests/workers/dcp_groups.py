"""A torch.distributed (gloo, CPU) rank of 3, for tests/test_dcp_conformance.py: DCP over
less than the whole job, as its users run it.

    dcp_groups.py DIR
        every rank saves a 2 MiB tensor to DIR/all; rank 0 alone saves and loads DIR/alone
        with dcp's `no_dist=True`; ranks 1 and 2 save DIR/pair over their own process group,
        and load DIR/all over it with read-once asked for (their ranks in that group are
        not their ranks in the job).

Reports what each rank loaded, as sums and first values.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import snapshard.torch as sst
from snapshard import ReadOptions, SaveOptions
from workers._dist import init_torch, report

N = 1 << 19  # 2 MiB of float32: above read-once's default size floor


def main() -> None:
    root = sys.argv[1]
    rank, _ = init_torch()
    opts = SaveOptions(timeout_s=60)
    pair = dist.new_group([1, 2])  # (every rank makes every group, in one order)
    out: dict[str, object] = {}
    dcp.save(
        {"t": torch.arange(N, dtype=torch.float32)},
        storage_writer=sst.StorageWriter(f"{root}/all", opts),
    )
    if rank == 0:
        state = {"w": torch.full((4,), 7.0)}
        dcp.save(state, storage_writer=sst.StorageWriter(f"{root}/alone", opts), no_dist=True)
        back = {"w": torch.zeros(4)}
        dcp.load(back, storage_reader=sst.StorageReader(f"{root}/alone"), no_dist=True)
        out["alone"] = back["w"].tolist()
    else:
        state = {"w": torch.full((4,), float(rank))}
        dcp.save(state, storage_writer=sst.StorageWriter(f"{root}/pair", opts), process_group=pair)
        back = {"t": torch.zeros(N)}
        once = sst.StorageReader(f"{root}/all", ReadOptions(read_once=True, timeout_s=60))
        dcp.load(back, storage_reader=once, process_group=pair)
        out["pair"] = [float(back["t"].sum()), back["t"][:3].tolist()]
    dist.barrier()
    report(rank=rank, **out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
