"""A torch.distributed (gloo, CPU) rank of the DCP read-once tests (4 ranks).

    dcp_read_once.py DIR                   dcp.save a state sharded over the 4 ranks through
                                           snapshard.torch.StorageWriter, then dcp.load it
                                           through StorageReader onto a (2 replicas x 2
                                           shards) mesh and as plain tensors, with read-once
                                           on, off and by default
    dcp_read_once.py DIR --fail-read RANK  the load with read-once on, where RANK's storage
                                           reads fail

Reports, per mode, whether every loaded tensor equals the saved one, and the bytes read from
storage and received from peers.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from workers._dist import failing_torch_load, init_torch, report_torch_results
from workers.torch_read_once import hsdp_target, state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--fail-read", type=int, default=None)
    ap.add_argument("--size-floor", action="store_true", help="keep READ_ONCE_MIN_BYTES")
    args = ap.parse_args()
    rank, world = init_torch()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import snapshard
    import snapshard.torch as st
    from snapshard.reading import read_once_policy

    # Where the default reads once (object stores), for tensors as small as these; the
    # size floor is tested with --size-floor.
    if not args.size_floor:
        read_once_policy.READ_ONCE_MIN_BYTES = 0

    want = {k: v for k, v in state().items() if k in ("a", "b", "c", "d")}
    flat = init_device_mesh("cpu", (world,))
    ckpt = os.path.join(args.root, "ckpt")
    if args.fail_read is None:
        saved = {
            "a": distribute_tensor(want["a"], flat, [Shard(0)]),
            "b": distribute_tensor(want["b"], flat, [Shard(0)]),
            "c": want["c"].clone(),  # a plain tensor: the same on every rank
            "d": distribute_tensor(want["d"], flat, [Replicate()]),
        }
        dcp.save(saved, storage_writer=st.StorageWriter(ckpt))
    dist.barrier()
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))

    def target() -> dict[str, torch.Tensor]:
        return {k: v for k, v in hsdp_target(hsdp).items() if k in want}

    def load(options: snapshard.ReadOptions) -> tuple[dict[str, torch.Tensor], st.StorageReader]:
        out = target()
        reader = st.StorageReader(ckpt, options)
        try:
            dcp.load(out, storage_reader=reader)
        except CheckpointException as e:  # DCP's, a BaseException: every rank's failures
            raise RuntimeError(str(e)) from e
        return out, reader

    if args.fail_read is not None:
        options = snapshard.ReadOptions(read_once=True, timeout_s=20)
        failing_torch_load(rank, args.fail_read, lambda: load(options))
    result: dict[str, object] = {}
    for mode in (True, False, None):  # None: the default, on for object stores
        out, reader = load(snapshard.ReadOptions(read_once=mode))
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in out.items()}
        result[f"{mode}"] = {
            "equal": {k: bool(torch.equal(full[k], want[k])) for k in want},
            "bytes_read": reader.stats.bytes_read,
            "bytes_from_peers": reader.stats.bytes_from_peers,
        }
    report_torch_results(rank, want, **result)


if __name__ == "__main__":
    main()
