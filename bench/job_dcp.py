"""PyTorch Distributed Checkpoint, one process, CPU tensors (the same bytes; bf16 as bf16).

dcp.save with FileSystemWriter(thread_count=1|2, sync_files=True): DCP fsyncs each data file
and its metadata; the directory fsync is added here, inside the time. dcp.load into
preallocated empty_like tensors, warm and after fadvise eviction.

usage: python job_dcp.py [--scale S] [--round R] [--variants t1,t2] [--no-evicted]
"""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

import common as bc

warnings.filterwarnings("ignore")


def to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == bc.np_dtype("bfloat16"):
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def run(variant, sd, path, record, evicted):
    bc.fresh_dir(path)
    bc.settle()
    res = {}
    try:
        with bc.Meter() as m:
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, thread_count=int(variant[1:])))
            bc.fsync_path(path)
        res.update(m.as_dict("save"))
        res["disk_B"], res["disk_files"] = bc.du_bytes(path)
        ok = True
        for step in ["restore_warm"] + (["restore_evicted"] if evicted else []):
            if step == "restore_evicted":
                bc.evict(path)
            dest = {k: torch.empty_like(v) for k, v in sd.items()}
            with bc.Meter() as m:
                dcp.load(dest, storage_reader=dcp.FileSystemReader(path))
            res.update(m.as_dict(step))
            if record:
                ok &= all(torch.equal(dest[k], sd[k]) for k in bc.CHECK_LEAVES)
            del dest
        res["bit_exact"] = ok
    finally:
        bc.remove(path)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--variants", default="t1,t2")
    ap.add_argument("--no-evicted", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    sd = {k: to_torch(bc.make_array(k, args.scale)) for k in bc.tree_spec(args.scale)}
    variants = args.variants.split(",")
    if args.round % 2:
        variants.reverse()  # alternate the order between rounds
    path = bc.ckpt_dir("dcp")
    for v in variants:
        run(v, {k: sd[k] for k in bc.WARMUP_LEAVES}, path + "-warmup", False, False)
    for v in variants:
        res = run(v, sd, path, True, not args.no_evicted)
        bc.emit(method=f"dcp_{v}", bytes=bc.payload_bytes(args.scale), **res)
    os.sync()


if __name__ == "__main__":
    main()
