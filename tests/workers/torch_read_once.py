"""A torch.distributed (gloo, CPU) rank of the torch read-once tests (4 ranks).

    torch_read_once.py DIR                   save a state sharded over the 4 ranks, then
                                             restore it onto a (2 replicas x 2 shards) mesh
                                             and as plain tensors, with read-once on, off and
                                             by default (DIR: a directory or an s3:// URL)
    torch_read_once.py DIR --fail-read RANK  the restore with read-once on, where RANK's
                                             storage reads fail
    ... --network R,...[/floor]              then (repeatable, one case each) the default
                                             restore where the mount table of ranks R,...
                                             (none: "") says DIR is on NFS, and the others'
                                             that it is on a local disk; with /floor, with
                                             the default's size floor (these tensors are all
                                             under it), without, a floor of 0

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
    """Deterministic leaves; every target box below is a whole number of saved chunks, so a
    restore needs exactly the unique bytes."""
    return {
        "a": torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64) * 0.5,
        "b": (torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) - 7).to(torch.bfloat16),
        "c": torch.linspace(-1, 1, 1000),
        "d": torch.arange(15, dtype=torch.int64).reshape(5, 3) * 3,
        "e": torch.arange(40 * 30, dtype=torch.float32).reshape(40, 30) / 7,
        "f": torch.arange(300, dtype=torch.float32) * 0.25,
    }


def hsdp_target(hsdp) -> dict[str, torch.Tensor]:
    """The restore's target on a (2 replicas x 2 shards) mesh, and plain tensors."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        "a": distribute_tensor(torch.zeros(256, 64), hsdp, [Replicate(), Shard(0)]),
        "b": distribute_tensor(
            torch.zeros(64, 32, dtype=torch.bfloat16), hsdp, [Replicate(), Shard(0)]
        ),
        "c": torch.zeros(1000),
        "d": distribute_tensor(
            torch.zeros(5, 3, dtype=torch.int64), hsdp, [Replicate(), Replicate()]
        ),
        # a strided view (read through a buffer, broadcast through a contiguous copy)
        "e": torch.zeros(30, 40).t(),
        "f": torch.zeros(300, dtype=torch.float64),  # cast on the host, then broadcast
    }


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-exact, after the cast the target asked for (float32 to float64 is exact)."""
    if got.dtype != want.dtype:
        want = want.to(got.dtype)
    return bool(torch.equal(got, want))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--fail-read", type=int, default=None)
    ap.add_argument("--network", action="append", default=[])
    args = ap.parse_args()
    rank, world = init_torch()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import snapshard
    import snapshard.torch as st
    from snapshard.reading import read_once_policy

    # Where the default reads once (object stores, network filesystems), for tensors as
    # small as these; the size floor is tested with --network R,.../floor.
    size_floor = read_once_policy.READ_ONCE_MIN_BYTES
    read_once_policy.READ_ONCE_MIN_BYTES = 0

    want = state()
    flat = init_device_mesh("cpu", (world,))
    saved = {
        "a": distribute_tensor(want["a"], flat, [Shard(0)]),
        "b": distribute_tensor(want["b"], flat, [Shard(0)]),
        "c": want["c"].clone(),  # a plain tensor: the same on every rank
        "d": distribute_tensor(want["d"], flat, [Replicate()]),
        "e": want["e"].clone(),
        "f": want["f"].clone(),
    }
    ckpt = os.path.join(args.root, "ckpt")
    if args.fail_read is None:
        st.save(ckpt, saved)
    dist.barrier()
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

    def target() -> dict[str, torch.Tensor]:
        return hsdp_target(hsdp)

    if args.fail_read is not None:
        options = snapshard.ReadOptions(read_once=True, timeout_s=20)
        failing_torch_load(rank, args.fail_read, lambda: st.load(ckpt, target(), options))

    def restored(mode: bool | None) -> dict[str, object]:
        out = target()
        stats = snapshard.ReadStats()
        st.load(ckpt, out, snapshard.ReadOptions(read_once=mode), stats=stats)
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in out.items()}
        return {
            "equal": {k: _same(full[k], want[k]) for k in want},
            "bytes_read": stats.bytes_read,
            "bytes_from_peers": stats.bytes_from_peers,
        }

    result: dict[str, object] = {}
    for mode in (True, False, None):  # None: the default, on for object stores and NFS
        result[f"{mode}"] = restored(mode)
    with st.CheckpointManager(
        os.path.join(args.root, "run"), read_options=snapshard.ReadOptions(read_once=True)
    ) as mgr:
        mgr.save(1, saved)
        mgr.wait_until_finished()
        out = mgr.restore(1, target())
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in out.items()}
        result["manager"] = {
            "equal": {k: _same(full[k], want[k]) for k in want},
            "bytes_read": mgr.last_restore.bytes_read_persistent,
            "bytes_from_peers": mgr.last_restore.bytes_from_peers,
        }
    for i, case in enumerate(args.network):  # the default where the mount table says NFS
        from snapshard.storage import mounts

        network, _, floor = case.partition("/")
        read_once_policy.READ_ONCE_MIN_BYTES = size_floor if floor else 0
        kind = "nfs4" if str(rank) in network.split(",") else "ext4"
        table = os.path.join(args.root, f"mountinfo-{i}-{rank}")
        with open(table, "w") as f:
            f.write("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
            f.write(f"30 22 0:40 / {os.path.realpath(args.root)} rw - {kind} srv:/x rw\n")
        mounts.MOUNTINFO = table
        result[f"network:{case}"] = restored(None)
    report_torch_results(rank, want, **result)


if __name__ == "__main__":
    main()
