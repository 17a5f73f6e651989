"""A torch.distributed (gloo, CPU) rank of a test of state that differs by rank.

    trees_differ.py save DIR STAGES HOW
        a 4-layer model cut into STAGES pipeline stages over this world (the ranks of a
        stage hold its layers with FSDP2 over the stage's own ranks: DTensors on a
        sub-mesh; with one rank a stage its plain tensors), one AdamW step, the model and
        the optimizer state (get_state_dict, flattened) saved with SaveOptions(trees_differ):
        HOW is sync, async or manager
    trees_differ.py load DIR STAGES HOW
        a fresh model cut into STAGES stages, its state loaded from DIR through HOW: torch
        (snapshard.torch.load), torch-once (the same with read-once asked for), dcp
        (dcp.load with snapshard.torch.StorageReader), manager (snapshard.torch.
        CheckpointManager of the directory above) or whole (no target: every entry as CPU
        tensors); HOW may list several, comma-separated
    trees_differ.py uneven DIR  rank 0 alone holds state, a per-process value among it
    trees_differ.py clash DIR   every rank gives "shared" with another shape and a key of its
                            own: the save fails on every rank, with trees_differ and without
    trees_differ.py titan-save DIR / titan-load DIR
        torchtitan's manager with two pipeline stages per rank (rank r: layers r and
        r + world), then one rank holding every layer loading it as an evaluation job
    trees_differ.py moe-save DIR EP OPT / moe-load DIR EP OPT
        a mixture-of-experts block: 8 experts as DTensors Shard(0) over an `ep` mesh of EP
        ranks (times `dp` FSDP where the world is larger), a replicated router; trained
        one step with OPT (adamw, sgd or muon) and saved / loaded at expert degree EP

Reports the sha256 of the full value of every entry of the state this rank holds (DTensors
gathered), keyed by name: the test compares them across saves and loads.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from snapshard import SaveOptions
from workers._dist import init_torch, report

LAYERS = 4


def digest(t: object) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, torch.Tensor):
        return hashlib.sha256(
            t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        ).hexdigest()
    return repr(t)


def flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}/"))
        return out
    return {prefix.rstrip("/"): tree}


class Stage(nn.Module):
    def __init__(self, layers: list[int], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        every = [nn.Linear(4, 4) for _ in range(LAYERS)]  # one draw for the whole model
        self.layers = nn.ModuleDict({str(i): every[i] for i in layers})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def stage_model(stages: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """This rank's stage: its layers, FSDP2 over its stage's ranks where there are several."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    per_stage = world // stages
    stage = rank // per_stage
    layers = [i for i in range(LAYERS) if i * stages // LAYERS == stage]
    model = Stage(layers, seed)
    if per_stage > 1:
        mesh = init_device_mesh("cpu", (stages, per_stage), mesh_dim_names=("pp", "dp"))
        fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.ones(2, 4) * (stage + 1)
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


def state_of(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, object]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    return {"model": msd, "optim": osd}


def put_back(model: nn.Module, optim: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"],
        options=StateDictOptions(flatten_optimizer_state_dict=True),
    )  # fmt: skip


def hashes(state: dict) -> dict[str, str]:
    # (in one order on every rank: a DTensor's digest gathers it, a collective of its mesh)
    return {k: digest(v) for k, v in sorted(flat(state).items())}


def save(path: str, stages: int, how: str) -> None:
    import snapshard.torch

    model, optim = stage_model(stages, seed=0)
    state = state_of(model, optim)
    if dist.get_rank() % 2:  # the ranks' own leaf orders then differ from the union's
        state = {k: state[k] for k in reversed(state)}
    options = SaveOptions(trees_differ=True)
    if how == "sync":
        snapshard.torch.save(path, state, options)
    elif how == "async":
        snapshard.torch.save_async(path, state, options).wait()
    else:
        with snapshard.torch.CheckpointManager(path, save_options=options) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()
    report(hashes=hashes(state))


def load(path: str, stages: int, hows: str) -> None:
    """Load through each of `hows` (comma-separated) in turn, into a fresh model each time."""
    import snapshard.torch
    from snapshard import ReadOptions

    out = {}
    for how in hows.split(","):
        if how == "whole":  # no target: every entry as CPU tensors
            out[how] = hashes(snapshard.torch.load(path))
            continue
        model, optim = stage_model(stages, seed=1)  # other values: the load must replace them
        state = state_of(model, optim)
        if how in ("torch", "torch-once"):
            # read-once asked for: the ranks' targets differ, so each reads its own
            snapshard.torch.load(path, state, ReadOptions(read_once=how == "torch-once"))
        elif how == "dcp":
            import torch.distributed.checkpoint as dcp

            dcp.load(state, storage_reader=snapshard.torch.StorageReader(path))
        else:  # the manager of the directory above, its step of this checkpoint
            root, step = os.path.split(path)
            with snapshard.torch.CheckpointManager(root) as mgr:
                mgr.restore(int(step), state)
        put_back(model, optim, state)
        out[how] = hashes(state_of(model, optim))
    report(hashes=out)


def clash(path: str) -> None:
    """Saves of 2 ranks whose trees clash, each reported as its error and whether a
    checkpoint exists after it: "True" / "False", rank r gives "shared" with r + 2 elements
    and "own<r>" (with trees_differ and without); "dtensors", rank r gives "x" (valued r)
    as a DTensor on its own stage's sub-mesh; "plain-dtensor", rank 0 a plain tensor and
    rank 1 a DTensor of the same shape. Without trees_differ, where a DTensor on a stage's
    sub-mesh is taken to be copied along the other stage: "stages" and "stages-writer" (the
    same through save_async and a writer process), rank r's stage gives "w" and "b" valued
    r under the same names; "copies", both give them equal (copies indeed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import snapshard.torch

    rank = dist.get_rank()
    stage = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"]
    x = torch.full((4,), float(rank))
    shared = {"shared": torch.zeros(2 + rank), f"own{rank}": torch.ones(3)}
    saves = {
        "True": (shared, True),
        "False": (shared, False),
        "dtensors": ({"x": distribute_tensor(x, stage, [Replicate()])}, True),
        "plain-dtensor": ({"x": x if rank == 0 else distribute_tensor(x, stage, [Replicate()])}, True),
        "stages": (_stage_state(stage, float(rank)), False),
        "stages-writer": (_stage_state(stage, float(rank)), False),
        "copies": (_stage_state(stage, 7.0), False),
    }  # fmt: skip
    out = {}
    for name, (state, trees_differ) in saves.items():
        where = f"{path}/{name}"
        try:
            if name == "stages-writer":
                options = SaveOptions(background="process")
                snapshard.torch.save_async(where, state, options).wait()
            else:
                snapshard.torch.save(where, state, SaveOptions(trees_differ=trees_differ))
            out[name] = {"error": None, "exists": os.path.exists(where)}
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            out[name] = {"error": error, "exists": os.path.exists(where)}
    report(**out)


def _stage_state(mesh: object, value: float) -> dict[str, object]:
    """A stage's state under stage-local names, its tensors valued `value`, on `mesh`."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {
        "0.weight": distribute_tensor(torch.full((4, 3), value), mesh, [Shard(0)]),
        "0.bias": distribute_tensor(torch.full((4,), value), mesh, [Replicate()]),
        "step": torch.tensor(3.0),
    }


def submesh(path: str) -> None:
    """4 ranks, a (pp 2, dp 2) mesh; without trees_differ, "w" sharded over each stage's dp
    sub-mesh: "copies", the same tensor on both stages (each dp position's shard copied
    along pp), saved and loaded back; "drift", the copies apart in their last bits (a
    replicated parameter each rank updates itself), saved; "mixed", each stage's own values
    under the same name, refused. Reports each save's error and whether it exists, and the
    copies' loaded values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import snapshard.torch

    rank = dist.get_rank()
    dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    full = torch.arange(24.0).reshape(8, 3)
    out: dict[str, object] = {}
    drift = full * (1 + 1e-6 * (rank // 2))  # last bits apart along pp (kernels' order)
    for name, value in (
        ("copies", full),
        ("drift", drift),
        ("mixed", full if rank < 2 else -full - 1),
    ):
        where = f"{path}/{name}"
        state = {"w": distribute_tensor(value, dp, [Shard(0)], src_data_rank=None)}
        try:
            snapshard.torch.save(where, state)
            out[name] = {"error": None, "exists": os.path.exists(where)}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}", "exists": os.path.exists(where)}
    back = {"w": distribute_tensor(torch.zeros(8, 3), dp, [Shard(0)])}
    snapshard.torch.load(f"{path}/copies", back)
    out["loaded"] = back["w"].full_tensor().tolist()
    report(**out)


def uneven(path: str) -> None:
    """Rank 0 alone holds state (a tensor and its data loader's position as a
    snapshard.PerProcess); rank 1 holds none. Saved, then loaded by both as they saved it,
    with read-once asked for and by default, and with no target."""
    import snapshard
    import snapshard.torch

    rank = dist.get_rank()
    w = torch.arange(4.0)
    state = {"w": w, "loader": snapshard.PerProcess({"seen": 17})} if rank == 0 else {}
    snapshard.torch.save(path, state, SaveOptions(trees_differ=True))
    out = {}
    for once in (True, None):
        target = {"w": torch.zeros(4), "loader": snapshard.PerProcess(None)} if rank == 0 else {}
        got = snapshard.torch.load(path, target, snapshard.ReadOptions(read_once=once))
        out[str(once)] = {
            k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in got.items()
        }
    try:  # no target: what was saved, the per-process values this rank saved among it
        got = snapshard.torch.load(path)
        out["all"] = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in got.items()}
    except Exception as e:
        out["all"] = f"{type(e).__name__}: {e}"
    report(loaded=out)


# --- expert parallelism --------------------------------------------------------------

EXPERTS = 8


class MuonLike(torch.optim.Optimizer):
    """The state of Muon (a `momentum_buffer` per parameter; Muon orthogonalises it before
    the update, which changes nothing of what is saved)."""

    def __init__(self, params: object, lr: float = 0.02, momentum: float = 0.95) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def moe(ep: int, opt: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A router (plain, on every rank) and EXPERTS experts as one (8, 4, 6) DTensor,
    Shard(0) over an `ep` mesh dimension of `ep` ranks, times FSDP Shard(1) over `dp`
    where the world is larger; one optimizer step from fixed gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    torch.manual_seed(seed)
    block = nn.Module()
    block.router = nn.Linear(4, EXPERTS)
    experts = torch.randn(EXPERTS, 4, 6)
    grad = torch.arange(experts.numel(), dtype=torch.float32).reshape(experts.shape) / 100
    if world == ep:
        mesh, placements = init_device_mesh("cpu", (ep,), mesh_dim_names=("ep",)), [Shard(0)]
    else:
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("dp", "ep"))
        placements = [Shard(1), Shard(0)]
    block.experts = nn.Parameter(distribute_tensor(experts, mesh, placements))
    params = list(block.parameters())
    optim: torch.optim.Optimizer
    if opt == "adamw":
        optim = torch.optim.AdamW(params, lr=0.01)
    elif opt == "sgd":
        optim = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    else:
        optim = MuonLike(params)
    for _ in range(2):
        block.experts.grad = distribute_tensor(grad, mesh, placements)
        block.router.weight.grad = torch.full_like(block.router.weight, 0.5)
        block.router.bias.grad = torch.full_like(block.router.bias, -0.25)
        optim.step()
    return block, optim


OPTIMIZERS = ("adamw", "sgd", "muon")


def moe_save(path: str, ep: int) -> None:
    import snapshard.torch

    out = {}
    for opt in OPTIMIZERS:
        state = state_of(*moe(ep, opt, seed=0))
        snapshard.torch.save(f"{path}/{opt}", state)
        out[opt] = hashes(state)
    report(hashes=out)


def moe_load(path: str, ep: int) -> None:
    import snapshard.torch

    out = {}
    for opt in OPTIMIZERS:
        block, optim = moe(ep, opt, seed=1)
        state = state_of(block, optim)
        snapshard.torch.load(f"{path}/{opt}", state)
        put_back(block, optim, state)
        out[opt] = hashes(state_of(block, optim))
    report(hashes=out)


# --- torchtitan, pipeline stages ---------------------------------------------------------


def titan(directory: str, parts_of: list[list[int]], **config: object):
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from snapshard.torchtitan import CheckpointManager

    parts = [Stage(layers, seed=0) for layers in parts_of]
    optim = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
        ],
    ).build(model_parts=parts)
    mgr = CheckpointManager.Config(enable=True, folder="ckpt", **config).build(
        dataloader=None, model_parts=parts, optimizers=optim, lr_schedulers=None,
        states={}, sd_adapter=None, base_folder=directory,
    )  # fmt: skip
    return parts, optim, mgr


def titan_state(parts: list[nn.Module], optim: object) -> dict[str, str]:
    model = {k: v for p in parts for k, v in p.state_dict().items()}
    return {**{f"model/{k}": digest(v) for k, v in model.items()},
            **{f"optim/{k}": digest(v) for k, v in optim.state_dict().items()}}  # fmt: skip


def titan_save(directory: str) -> None:
    """Two stages on each rank (as an interleaved schedule gives them): rank r holds
    layers r and r + world."""
    rank, world = dist.get_rank(), dist.get_world_size()
    parts, optim, mgr = titan(directory, [[rank], [rank + world]], interval=1)
    for p in parts:
        p(torch.ones(2, 4)).sum().backward()
    optim.step()
    mgr.save(1, last_step=False)  # (a last step would save the model alone)
    mgr.maybe_wait_for_saving()
    mgr.close()
    report(hashes=titan_state(parts, optim))


def titan_load(directory: str) -> None:
    """One rank holding every layer, as an evaluation job: load_only."""
    parts, optim, mgr = titan(directory, [list(range(LAYERS))], load_only=True)
    for p in parts:
        p(torch.ones(2, 4)).sum().backward()
    optim.step()  # (state to load into)
    loaded = mgr.load()
    mgr.close()
    report(loaded=loaded, hashes=titan_state(parts, optim))


def main() -> None:
    init_torch()
    cmd, path, *rest = sys.argv[1:]
    if cmd == "save":
        save(path, int(rest[0]), rest[1])
    elif cmd == "load":
        load(path, int(rest[0]), rest[1])
    elif cmd == "clash":
        clash(path)
    elif cmd == "uneven":
        uneven(path)
    elif cmd == "submesh":
        submesh(path)
    elif cmd == "moe-save":
        moe_save(path, int(rest[0]))
    elif cmd == "moe-load":
        moe_load(path, int(rest[0]))
    elif cmd == "titan-save":
        titan_save(path)
    elif cmd == "titan-load":
        titan_load(path)
    else:
        raise SystemExit(f"unknown command {cmd}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
