"""A torch.distributed (gloo, CPU) rank of the tests of reshards that cut the saved rows.

    torch_bands.py DIR                   save a state as Shard(0) over the ranks, then restore
                                         it onto column shardings (a flat mesh and a 2-D mesh,
                                         one with columns replicated), with read-once on and off
    torch_bands.py DIR --fail-read RANK  the restore with read-once on, where RANK's storage
                                         reads fail: those of its bands (the target holds
                                         banded leaves only), or with --plain its first
                                         ordinary read, before any band; with
                                         --collective, the bands go through the
                                         all-to-all instead of shared memory

Reports, per rank and mode, whether every restored tensor equals the saved one, and the
bytes read from storage and received from peers.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from workers._dist import failing_torch_load, init_torch, report_torch_results


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(256, 512, generator=g),
        "v": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        "x": torch.randint(-(1 << 30), 1 << 30, (32, 8, 16), generator=g, dtype=torch.int32),
        "u": torch.randn(30, 12, generator=g),  # bands of 7 and 8 rows
        "t": torch.arange(48, dtype=torch.int32).reshape(3, 16),  # fewer rows than ranks
        "b": torch.randn(64, generator=g),  # 1-D: read as usual
        "r": torch.randn(40, 64, generator=g),  # columns replicated over the grid's rows
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--fail-read", type=int, default=None)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--collective", action="store_true", help="no shared memory")
    args = ap.parse_args()
    rank, world = init_torch()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import snapshard
    import snapshard.torch as st
    from snapshard.coordination import peer_memory

    want = state()
    flat = init_device_mesh("cpu", (world,))
    ckpt = os.path.join(args.root, "ckpt")
    if args.fail_read is None:
        st.save(ckpt, {k: distribute_tensor(v, flat, [Shard(0)]) for k, v in want.items()})
    dist.barrier()
    grid = init_device_mesh("cpu", (2, world // 2))

    def target() -> dict[str, torch.Tensor]:
        return {
            "w": distribute_tensor(torch.zeros(256, 512), flat, [Shard(1)]),
            # cast on the way: bfloat16 saved, float32 asked for
            "v": distribute_tensor(torch.zeros(64, 96), flat, [Shard(1)]),
            "x": distribute_tensor(
                torch.zeros(32, 8, 16, dtype=torch.int32), grid, [Shard(2), Shard(1)]
            ),
            "u": distribute_tensor(torch.zeros(30, 12), flat, [Shard(1)]),
            "t": distribute_tensor(torch.zeros(3, 16, dtype=torch.int32), flat, [Shard(1)]),
            "b": distribute_tensor(torch.zeros(64), flat, [Shard(0)]),
            "r": distribute_tensor(torch.zeros(40, 64), grid, [Replicate(), Shard(1)]),
        }

    if args.fail_read is not None:
        peer_memory.ENABLED = not args.collective
        options = snapshard.ReadOptions(read_once=True, timeout_s=20)
        fail_target = target() if args.plain else {"w": target()["w"], "v": target()["v"]}
        failing_torch_load(rank, args.fail_read, lambda: st.load(ckpt, fail_target, options))
    result: dict[str, object] = {}
    store = dist.distributed_c10d._get_default_store()
    # (the mesh's subgroups above put their own keys in the store, rank by rank: count
    # once every rank has made them)
    dist.barrier()
    keys_before = store.num_keys()
    runs = [
        ("True/None", True, None, None),
        ("True/100000", True, 100_000, None),
        ("collective/100000", True, 100_000, None),  # all_to_all, not shared memory
        ("False/None", False, None, None),
        ("replicated/None", True, None, "r"),  # alone, so that its bytes are countable
        ("replicated/4096", True, 4096, "r"),  # in slabs of a few rows
    ]
    for label, mode, budget, only in runs:
        peer_memory.ENABLED = not label.startswith("collective")
        out = target()
        if only is not None:
            out = {only: out[only]}
        stats = snapshard.ReadStats()
        options = snapshard.ReadOptions(read_once=mode, memory_budget=budget)
        st.load(ckpt, out, options, stats=stats)
        result[label] = {
            "equal": {
                k: bool(torch.equal(out[k].full_tensor(), want[k].to(out[k].dtype))) for k in out
            },
            "bytes_read": stats.bytes_read,
            "bytes_from_peers": stats.bytes_from_peers,
        }
    dist.barrier()  # every rank is done: the last to read an outcome deletes its keys
    result["store_keys_added"] = store.num_keys() - keys_before
    report_torch_results(rank, want, **result)


if __name__ == "__main__":
    main()
