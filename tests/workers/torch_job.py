"""A torch.distributed (gloo, CPU) rank of a multi-process snapshard.torch test.

    torch_job.py save DIR     every rank: train a tiny model with FSDP2 (1-D over all ranks)
                              and FSDP2 x TP (2-D, with 4 ranks), save model + Adam state
                              (sync, and async followed at once by another optimizer step)
    torch_job.py dies DIR     rank 1 leaves without saving; rank 0's save must fail naming it
    torch_job.py load DIR     every rank: FSDP2 (and FSDP2 x TP with 4 ranks) over this world
                              size, load each saved state into it
    torch_job.py managed DIR  every rank: train 7 steps with FSDP2 + Adam, saving through
                              snapshard.torch.CheckpointManager (async, every 2 steps, keep 2)
    torch_job.py managed-restore DIR   a fresh model restores the manager's newest step
    torch_job.py preempt DIR  every rank: train with FSDP2 + Adam and an all_reduce each step;
                              rank 1 gets SIGTERM at step 3; every rank saves when
                              reached_preemption says so, then restores that step
    torch_job.py dcp-save DIR every rank: FSDP2 + Adam state (and a bf16 tensor) saved
                              with torch.distributed.checkpoint.save
    torch_job.py transposed DIR  every rank: DTensors sharded by rows and by columns filled
                              from DIR/jax (JAX names, (in, out) kernels) through renames
                              and transposes; reports its local shards

Reports, per saved state, the sha256 of every entry's full value: the test compares them.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from snapshard import ReadOptions, SaveOptions
from workers._dist import init_torch, report


class Tiny(nn.Module):
    # Odd sizes: uneven shards, and empty ones over 4 ranks (5 rows: 2, 2, 1, 0).
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 5)
        self.norm = nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.relu(self.up(x))))


def build(kind: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny()
    if kind == "2d":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for m in (model.up, model.down):
        fully_shard(m, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def strided(world: int, zeros: bool) -> object:
    """A (10, 3) DTensor with strided sharding alone: each rank's rows are not contiguous
    (4 ranks: {0, 1, 5, 6}, {2, 3, 7, 8}, {4, 9} and none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    p = _StridedShard(0, split_factor=2)
    g = torch.arange(30, dtype=torch.float32).reshape(10, 3) + 0.5
    local = p._split_tensor(g, world, with_padding=False, contiguous=True)[0][dist.get_rank()]
    local = torch.zeros_like(local) if zeros else local.clone()
    return DTensor.from_local(local, mesh, [p], run_check=False, shape=g.shape, stride=g.stride())


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def flat_items(tree, path=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat_items(v, (*path, str(k)))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from flat_items(v, (*path, str(i)))
    else:
        yield "/".join(path), tree


def digests(state) -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, v in flat_items(state):
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            v = v.detach().contiguous()
            out[name] = (
                f"{v.dtype}:{tuple(v.shape)}:"
                + hashlib.sha256(v.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
            )
        else:
            out[name] = repr(v)
    return out


def plan_digest(state) -> str:
    """A digest of the write plan this rank computes for `state` (every rank must agree)."""
    from snapshard.planning import plan_writes
    from snapshard.torch.leaves import classify, is_leaf
    from snapshard.tree import flatten

    flat = flatten(state, is_leaf)
    arrays = [
        classify(p, v, dist.get_world_size()) for p, v in zip(flat.paths, flat.leaves, strict=True)
    ]
    layouts = [a.layout for a in arrays if hasattr(a, "layout")]
    plan = plan_writes(layouts, "auto", num_processes=dist.get_world_size())
    h = hashlib.sha256(plan.mode.encode())
    for a in plan.arrays:
        for x in (a.starts, a.stops, a.writer):
            h.update(x.astype("int64").tobytes())
    return h.hexdigest()[:16]


def managed(cmd: str, root: str, rank: int, world: int) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import snapshard.torch as st

    out: dict[str, object] = {}
    model, opt = build("1d", world)
    mgr = st.CheckpointManager(
        root,
        save_interval_steps=2,
        max_to_keep=2,
        save_options=SaveOptions(timeout_s=60),
        read_options=ReadOptions(timeout_s=60),
    )
    out["coordinator"] = type(mgr._coord).__name__
    if cmd == "managed":
        saved = {}
        for step in range(1, 8):
            train(model, opt, 1, seed=1000 * rank + step)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": step}
            if mgr.save(step, state, metrics={"step": step}):
                saved[step] = digests(state)
        mgr.wait_until_finished()
        out["saved"] = saved
        out["steps"] = mgr.all_steps()
        out["timings"] = sorted(mgr.save_timings())
    else:
        train(model, opt, 1, seed=7)  # other values, same structure (Adam's state exists)
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd, "step": 0}
        out["steps"] = mgr.all_steps()
        out["latest"] = mgr.latest_step()
        assert mgr.restore(None, target) is target
        set_state_dict(
            model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
        msd, osd = get_state_dict(model, opt)
        out["restored"] = digests({"model": msd, "optim": osd, "step": target["step"]})
        out["tier"] = mgr.last_restore.tier if mgr.last_restore else None
    mgr.close()
    return out


SIGNALLED_AT = 3


def preempt(root: str, rank: int, world: int) -> dict[str, object]:
    import signal
    import time

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import snapshard.torch as st

    model, opt = build("1d", world)
    from snapshard.manager import ManagerPolicies, PreemptionPolicy

    sigterm = ManagerPolicies(preemption=PreemptionPolicy(handle_sigterm=True))
    mgr = st.CheckpointManager(
        root,
        save_interval_steps=1000,
        policies=sigterm,
        save_options=SaveOptions(timeout_s=30),
        read_options=ReadOptions(timeout_s=30),
    )
    out: dict[str, object] = {"agreed": None}
    for step in range(1, 30):
        train(model, opt, 1, seed=1000 * rank + step)
        dist.all_reduce(torch.ones(1))  # the ranks stay in step
        if rank == 1 and step == SIGNALLED_AT:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # rank 0 has checked this step already, finding nothing
        if mgr.should_save(step) or mgr.reached_preemption(step):
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": step}
            assert mgr.save(step, state, force=True)
            out["agreed"] = step
            out["saved"] = digests(state)
            break
    mgr.wait_until_finished()
    out["steps"] = mgr.all_steps()
    if out["agreed"] is not None:
        model, opt = build("1d", world)
        train(model, opt, 1, seed=7)  # other values, same structure
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd, "step": 0}
        mgr.restore(out["agreed"], target)
        set_state_dict(
            model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"]
        )
        msd, osd = get_state_dict(model, opt)
        out["restored"] = digests({"model": msd, "optim": osd, "step": target["step"]})
    mgr.close()
    return out


def main() -> None:
    cmd, root = sys.argv[1], sys.argv[2]
    rank, world = init_torch()
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import snapshard.torch as st

    result: dict[str, object] = {}
    if cmd == "dies":
        if rank == 1:
            os._exit(0)
        try:
            st.save(
                os.path.join(root, "never"), {"w": torch.zeros(4)}, options=SaveOptions(timeout_s=3)
            )
            report(error=None)
        except Exception as e:
            report(
                error=f"{type(e).__name__}: {e}", exists=os.path.exists(os.path.join(root, "never"))
            )
        os._exit(0)
    kinds = ["1d", "2d"] if world == 4 else ["1d"]
    if cmd == "transposed":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        import snapshard
        from snapshard.safetensors import surgery as S

        mesh = init_device_mesh("cpu", (world,))
        zeros = torch.zeros(7, 5)  # torch's (out, in) of a (5, 7) kernel
        target = {
            "rows.weight": distribute_tensor(zeros, mesh, [Shard(0)]),
            "cols.weight": distribute_tensor(zeros.clone(), mesh, [Shard(1)]),
            "rows.bias": torch.zeros(7),
        }
        stats = snapshard.ReadStats()
        st.load(
            os.path.join(root, "jax"),
            target,
            stats=stats,
            transform=S.chain(
                S.transpose(r"params/.*/kernel"),
                S.rename(r"params/(\w+)/kernel", r"\1.weight"),
                S.rename(r"params/(\w+)/bias", r"\1.bias"),
            ),
        )
        result = {
            k: v.to_local().tolist() if hasattr(v, "to_local") else v.tolist()
            for k, v in target.items()
        }
        result["bytes_needed"] = stats.bytes_needed
        dist.barrier()
        report(rank=rank, **result)
        dist.destroy_process_group()
        return
    if cmd in ("managed", "managed-restore"):
        result = managed(cmd, root, rank, world)
    elif cmd == "preempt":
        result = preempt(root, rank, world)
    elif cmd == "dcp-save":
        import torch.distributed.checkpoint as dcp

        model, opt = build("1d", world)
        train(model, opt, 2, seed=rank)
        msd, osd = get_state_dict(model, opt)
        state = {
            "model": msd,
            "optim": osd,
            "half": torch.linspace(-3, 3, 7, dtype=torch.bfloat16),
            "step": 2,
        }
        dcp.save(state, checkpoint_id=os.path.join(root, "dcp"))
        result["saved"] = digests(state)
    elif cmd == "save":
        for kind in kinds:
            model, opt = build(kind, world)
            train(model, opt, 2, seed=rank)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": 2}
            if kind == "1d":
                state["strided"] = strided(world, zeros=False)
            result[kind] = digests(state)
            result[f"{kind}-plan"] = plan_digest(state)
            st.save(os.path.join(root, kind), state, options=SaveOptions(timeout_s=60))
            job = st.save_async(
                os.path.join(root, f"{kind}-async"), state, options=SaveOptions(timeout_s=60)
            )
            train(model, opt, 1, seed=100 + rank)  # in place, while the save writes
            job.wait()
            result[f"{kind}-after"] = digests(state)
        result["placements"] = sorted(
            {str(v.placements) for _, v in flat_items(msd) if hasattr(v, "placements")}
        )
    else:
        for name in sorted(os.listdir(root)):
            for kind in kinds:
                model, opt = build(kind, world)
                train(model, opt, 1, seed=7)  # different values, same structure
                msd, osd = get_state_dict(model, opt)
                target = {"model": msd, "optim": osd, "step": 0}
                if name.startswith("1d"):
                    target["strided"] = strided(world, zeros=True)
                out = st.load(os.path.join(root, name), target)
                assert out is target
                set_state_dict(
                    model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"]
                )
                msd, osd = get_state_dict(model, opt)
                loaded = {"model": msd, "optim": osd, "step": target["step"]}
                if "strided" in target:
                    loaded["strided"] = target["strided"]
                    want = torch.arange(30, dtype=torch.float32).reshape(10, 3) + 0.5
                    assert torch.equal(target["strided"].full_tensor(), want)
                result[f"{name}@{kind}"] = digests(loaded)
    dist.barrier()
    report(rank=rank, **result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Results are reported: leave without the interpreter's teardown, where a thread torch
    # left behind once aborted a rank under load ("terminate called without an active
    # exception") after everything had passed.
    sys.stdout.flush()
    os._exit(0)
