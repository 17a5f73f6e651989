"""snapshard on NVIDIA GPUs: torch CUDA tensors through snapshard.torch.save/load and
save_async, a DTensor over an NCCL process group of one rank, and JAX arrays on a GPU.

Marked `cuda`; every test skips where there is no CUDA device (CI, the CPU-only machines),
and the JAX one also where JAX runs on the CPU (the conftest pins JAX_PLATFORMS=cpu unless
it is set: scripts/device_check.sh runs `pytest -m cuda` with JAX_PLATFORMS empty, so JAX
picks the GPU).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.cuda


def _torch_cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    return torch


def _state(torch: Any) -> dict[str, Any]:
    """Tensors of several dtypes on the GPU, one of them a strided view, and a Python value."""
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(64, 48, device=dev, generator=g)
    return {
        "w": w,
        "w_t": w.t(),  # not contiguous
        "bf16": torch.randn(33, 7, device=dev, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, device=dev, generator=g).to(torch.float16),
        "steps": torch.arange(10, device=dev, dtype=torch.int64),
        "mask": torch.rand(17, device=dev, generator=g) > 0.5,
        "nested": {"scalar": torch.tensor(3.5, device=dev)},
        "epoch": 7,
    }


def _tensors(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_tensors(v, f"{prefix}{k}."))
        elif hasattr(v, "device"):
            out[prefix + k] = v
    return out


def _zeros_like(torch: Any, tree: Any) -> Any:
    return {
        k: _zeros_like(torch, v)
        if isinstance(v, dict)
        else (torch.zeros_like(v).contiguous() if hasattr(v, "device") else v)
        for k, v in tree.items()
    }


def test_torch_cuda_tensors_round_trip(tmp_path: Path) -> None:
    torch = _torch_cuda()
    import snapshard.torch as st

    state = _state(torch)
    st.save(tmp_path / "c", state)
    target = _zeros_like(torch, state)
    st.load(tmp_path / "c", target)
    saved, got = _tensors(state), _tensors(target)
    assert saved.keys() == got.keys()
    for k, v in saved.items():
        assert got[k].is_cuda and got[k].dtype == v.dtype, k
        assert torch.equal(got[k], v), k
    # Without a target: CPU tensors with the same values, and the Python value.
    plain = st.load(tmp_path / "c")
    assert plain["epoch"] == 7
    for k, v in _tensors(plain).items():
        assert not v.is_cuda and torch.equal(v, saved[k].cpu()), k


def test_torch_cuda_save_async_keeps_the_bytes_of_its_call(tmp_path: Path) -> None:
    torch = _torch_cuda()
    import snapshard.torch as st

    state = _state(torch)
    before = {k: v.clone() for k, v in _tensors(state).items()}
    job = st.save_async(tmp_path / "c", state)
    # The call returned with the bytes on the host: the step may change the tensors now.
    for v in _tensors(state).values():
        if v.dtype == torch.bool:
            v.logical_not_()
        else:
            v.add_(1)
    torch.cuda.synchronize()
    timings = job.wait()
    assert 0 < timings.blocking_s <= timings.total_s
    target = _zeros_like(torch, state)
    st.load(tmp_path / "c", target)
    for k, v in _tensors(target).items():
        assert v.is_cuda and torch.equal(v, before[k]), k


def test_dtensor_on_an_nccl_world_of_one(tmp_path: Path) -> None:
    torch = _torch_cuda()
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import snapshard.torch as st

    torch.cuda.set_device(0)
    store = tmp_path / "store"
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=torch.device(0)
    )
    try:
        mesh = init_device_mesh("cuda", (1,))
        full = torch.randn(12, 10, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        state = {
            "w": distribute_tensor(full, mesh, [Shard(0)]),
            "r": distribute_tensor(full[:3].clone(), mesh, [Replicate()]),
        }
        st.save(tmp_path / "c", state)
        target = {
            "w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)]),
            "r": distribute_tensor(torch.zeros(3, 10, device="cuda"), mesh, [Replicate()]),
        }
        st.load(tmp_path / "c", target)
        assert isinstance(target["w"], DTensor) and target["w"].to_local().is_cuda
        assert torch.equal(target["w"].full_tensor(), full)
        assert torch.equal(target["r"].full_tensor(), full[:3])
        # ... and into a plain CUDA tensor.
        plain = {"w": torch.zeros_like(full), "r": torch.zeros(3, 10, device="cuda")}
        st.load(tmp_path / "c", plain)
        assert torch.equal(plain["w"], full)
    finally:
        dist.destroy_process_group()


def _jax_gpus() -> list[Any]:
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip(f"no JAX GPU backend (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})")
    return list(gpus)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "save_async"])
def test_jax_arrays_on_the_gpu(tmp_path: Path, asynchronous: bool) -> None:
    gpus = _jax_gpus()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    n = len(gpus)
    mesh = Mesh(np.array(gpus), ("d",))
    rows = NamedSharding(mesh, P("d"))
    whole = NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    host = {
        "w": rng.standard_normal((8 * n, 24), dtype=np.float32),
        "e": rng.standard_normal((4 * n, 6), dtype=np.float32).astype(jnp.bfloat16),
        "b": np.arange(24, dtype=np.int32),
    }
    sh = {"w": rows, "e": rows, "b": whole}
    tree = {k: jax.device_put(v, sh[k]) for k, v in host.items()}
    path = tmp_path / "c"
    if asynchronous:
        job = snapshard.save_async(path, tree)
        # The bytes are on the host: the arrays may go.
        for x in tree.values():
            x.delete()
        assert job.wait().total_s > 0
    else:
        snapshard.save(path, tree)
    # Restore onto the other layout: replicated weights, row-sharded biases where they divide.
    swap = {"w": whole, "e": whole, "b": rows if 24 % n == 0 else whole}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=swap[k]) for k, v in host.items()}
    out = snapshard.load(path, target)
    for k, v in host.items():
        assert out[k].sharding == swap[k], k
        assert {d.platform for d in out[k].devices()} == {"gpu"}, k
        np.testing.assert_array_equal(np.asarray(out[k]), v)


def test_a_shard_s_fingerprint_is_the_same_on_the_gpu_as_on_the_cpu():
    """Copies of a DTensor's part are compared by fingerprint at the commit (saving/
    copies.py): a rank holding its part on the GPU and one holding it on the CPU, strided or
    not, of any dtype, must agree, the GPU's samples gathered in one transfer."""
    torch = _torch_cuda()
    from snapshard.torch.leaves import TorchSource

    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(300, 200, generator=g), torch.randn(8, 8, generator=g)]
    parts += [parts[0].t(), parts[1].to(torch.bfloat16), torch.tensor(2.5)]
    starts = np.zeros((1, 2), np.int64)
    on_cpu = TorchSource.copy_digests([TorchSource(p, starts) for p in parts])
    on_gpu = TorchSource.copy_digests([TorchSource(p.cuda(), starts) for p in parts])
    assert on_cpu == on_gpu
