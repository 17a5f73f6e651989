"""Plain baselines: np.save of each array, and safetensors, both fsync'd here (the libraries
do not fsync), inside the time.

npsave      : one .npy per array (bf16 as its uint16 bits), each file and the directory
              fsync'd; restore is np.load of every file into fresh memory.
safetensors : safetensors.torch.save_file to one file, file and directory fsync'd; restore
              is load_file (lazy, mmap) followed by .clone() of every tensor so the bytes
              are really read.

usage: python job_plain.py [--scale S] [--round R] [--variants npsave,safetensors]
"""

from __future__ import annotations

import argparse
import os
import warnings

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import common as bc

warnings.filterwarnings("ignore")
BF16 = bc.np_dtype("bfloat16")


def raw(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == BF16 else a


def to_torch(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(raw(a)).view(torch.bfloat16) if a.dtype == BF16 else torch.from_numpy(a)


def save(variant, tree, sd, path):
    os.makedirs(path)
    if variant == "npsave":
        for k, a in tree.items():
            with open(os.path.join(path, k + ".npy"), "wb") as f:
                np.save(f, raw(a))
                f.flush()
                os.fsync(f.fileno())
    else:
        save_file(sd, os.path.join(path, "model.safetensors"))
        bc.fsync_path(os.path.join(path, "model.safetensors"))
    bc.fsync_path(path)
    bc.fsync_path(os.path.dirname(path))


def load(variant, tree, path):
    if variant == "npsave":
        return {k: np.load(os.path.join(path, k + ".npy")) for k in tree}
    lazy = load_file(os.path.join(path, "model.safetensors"))
    return {k: v.clone() for k, v in lazy.items()}


def run(variant, tree, sd, path, record, evicted):
    bc.fresh_dir(path)
    bc.settle()
    res = {}
    try:
        with bc.Meter() as m:
            save(variant, tree, sd, path)
        res.update(m.as_dict("save"))
        res["disk_B"], res["disk_files"] = bc.du_bytes(path)
        ok = True
        for step in ["restore_warm"] + (["restore_evicted"] if evicted else []):
            if step == "restore_evicted":
                bc.evict(path)
            with bc.Meter() as m:
                out = load(variant, tree, path)
            res.update(m.as_dict(step))
            if record:
                for k in bc.CHECK_LEAVES:
                    if variant == "npsave":
                        ok &= np.array_equal(out[k], raw(tree[k]))
                    else:
                        ok &= torch.equal(out[k], sd[k])
            del out
        res["bit_exact"] = bool(ok)
    finally:
        bc.remove(path)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--variants", default="npsave,safetensors")
    ap.add_argument("--no-evicted", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    tree = {k: bc.make_array(k, args.scale) for k in bc.tree_spec(args.scale)}
    sd = {k: to_torch(v) for k, v in tree.items()}
    variants = args.variants.split(",")
    if args.round % 2:
        variants.reverse()
    path = bc.ckpt_dir("plain")
    for v in variants:
        ks = bc.WARMUP_LEAVES
        run(v, {k: tree[k] for k in ks}, {k: sd[k] for k in ks}, path + "-warmup", False, False)
    for v in variants:
        res = run(v, tree, sd, path, True, not args.no_evicted)
        bc.emit(method=v, bytes=bc.payload_bytes(args.scale), **res)
    os.sync()


if __name__ == "__main__":
    main()
