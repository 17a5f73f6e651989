"""Train a small transformer with FSDP2 (and optionally FSDP x tensor parallel) and
snapshard.torch.CheckpointManager; resume bit-exactly after a kill, or onto another mesh.

    torchrun --nproc-per-node 2 examples/fsdp_train.py --dir /tmp/run --steps 12
    torchrun --nproc-per-node 4 examples/fsdp_train.py --dir /tmp/run --steps 12 --mesh 2x2
    torchrun --nproc-per-node 2 examples/fsdp_train.py --dir /tmp/run --steps 18  # resumes

Every rank runs this script (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); gloo
on CPU. `--mesh N` is 1-D FSDP over N ranks, `--mesh DxT` FSDP over D ranks x tensor
parallel over T (attention heads and MLP columns). A checkpoint is saved asynchronously
every `--save-every` steps (model, Adam state, step); a run started on a directory that has
one resumes from its newest committed step, on any world size and mesh.

Killed at any moment (SIGKILL included), a rerun on the same mesh prints the same losses as
a run never interrupted, bit for bit: the data of a step depends on the step alone and the
whole training state is in the checkpoint. On another data-parallel size the batch is split
differently, so the losses agree only to rounding; the restored state itself is the saved
one bit for bit, which `--digests` shows (a digest of the full state at each save and after
the restore, the same whatever the mesh).

Rank 0 prints `loss STEP HEX` (the global mean loss, float.hex), `saved STEP DIGEST` and
`restored STEP DIGEST`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import snapshard.torch as sst

VOCAB, DIM, HEADS, FFN, LAYERS, SEQ, BATCH = 97, 32, 4, 64, 2, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        # With tensor parallelism q, k, v hold this rank's heads only: -1 heads.
        q, k, v = (
            p(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(mesh_arg: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer, int, int]:
    """The model sharded on the mesh, its optimizer, and this rank's data-parallel index
    and the data-parallel size."""
    dims = [int(d) for d in mesh_arg.lower().split("x")] if mesh_arg else [world]
    if len(dims) not in (1, 2) or dims[0] * (dims[1] if len(dims) == 2 else 1) != world:
        raise SystemExit(f"--mesh {mesh_arg!r} does not fit {world} ranks")
    torch.manual_seed(0)  # the same initial model on every rank and every mesh
    model = Transformer()
    if len(dims) == 2:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", tuple(dims), mesh_dim_names=("dp", "tp"))
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()}
        plan |= {"o": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
        dp: DeviceMesh = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.Adam(model.parameters(), lr=3e-3), dp.get_local_rank(), dp.size()


def batch(step: int, dp_rank: int, dp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch: a function of the step alone."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    rows = tokens.chunk(dp_size)[dp_rank]
    return rows[:, :-1], rows[:, 1:]


def state_digest(state: Any) -> str:
    """sha256 of every entry's full value (a collective: every rank calls it)."""
    h = hashlib.sha256()

    def walk(node: Any, name: str) -> None:
        if isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(node[k], f"{name}/{k}")
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                walk(v, f"{name}/{i}")
        else:
            if isinstance(node, DTensor):
                node = node.full_tensor()
            if isinstance(node, torch.Tensor):
                t = node.detach().contiguous().cpu()
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(f"{name}={node!r}".encode())

    walk(state, "")
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", required=True, help="the checkpoint directory (steps inside)")
    ap.add_argument("--steps", type=int, default=12, help="train until this step")
    ap.add_argument(
        "--mesh", default="", help="N (1-D FSDP) or DxT (FSDP x TP); default: all ranks"
    )
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    ap.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (demos)")
    ap.add_argument("--digests", action="store_true", help="print state digests")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, dp_rank, dp_size = build(args.mesh, world)
    mgr = sst.CheckpointManager(
        args.dir, save_interval_steps=args.save_every, max_to_keep=args.keep
    )
    step = 0
    latest = mgr.latest_step()
    if latest is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": 0}
        mgr.restore(latest, state)  # in place, onto this mesh
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["step"]
        if args.digests:
            model_sd, optim_sd = get_state_dict(model, opt)
            digest = state_digest({"model": model_sd, "optim": optim_sd, "step": step})
            if rank == 0:
                print(f"restored {step} {digest}", flush=True)
    while step < args.steps:
        step += 1
        x, y = batch(step, dp_rank, dp_size)
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        report = loss.detach().clone()
        dist.all_reduce(report)  # tp ranks of one dp group hold the same loss
        if rank == 0:
            print(f"loss {step} {(report.item() / world).hex()}", flush=True)
        if mgr.should_save(step):
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd, "step": step}
            mgr.save(step, state)  # returns once this rank's bytes are copied
            if args.digests:
                digest = state_digest(state)
                if rank == 0:
                    print(f"saved {step} {digest}", flush=True)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    mgr.close()  # waits for the save in flight; raises its error if it failed
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
