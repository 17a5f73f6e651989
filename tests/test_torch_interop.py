"""One format for both frameworks: JAX-saved checkpoints restore into torch tensors and
torch-saved ones into jax.Arrays on any mesh, bit-exact."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

torch = pytest.importorskip("torch")

import snapshard  # noqa: E402
import snapshard.torch as st  # noqa: E402
from snapshard.torch.dtypes import host_view  # noqa: E402

from conftest import mesh, sharded  # noqa: E402


def _bits_np(a):
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def test_jax_checkpoint_into_torch_and_back(tmp_path):
    m = mesh(2, 4)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 12)).astype(np.float32)
    tree = {
        "params": {
            "w": sharded(w, m, "data", "model"),
            "b": sharded(jnp.asarray(rng.standard_normal(12), jnp.bfloat16), m, "model"),
            "q": sharded(
                jnp.asarray(rng.standard_normal((4, 8)), jnp.float8_e4m3fn), m, None, "data"
            ),
        },
        "step": 5,
    }
    snapshard.save(tmp_path / "jax", tree)
    target = {
        "params": {
            "w": torch.zeros(8, 12),
            "b": torch.zeros(12, dtype=torch.bfloat16),
            "q": torch.zeros(4, 8, dtype=torch.float8_e4m3fn),
        },
        "step": 0,
    }
    st.load(tmp_path / "jax", target)
    for k in ("w", "b", "q"):
        assert host_view(target["params"][k]).view(np.uint8).tobytes() == _bits_np(
            np.asarray(tree["params"][k])
        ), k
    assert target["step"] == 5
    # And back: the torch state saved, restored into jax.Arrays on another mesh.
    st.save(tmp_path / "torch", target)
    m2 = mesh(4, 2)
    abstract = {
        "params": {
            "w": jax.ShapeDtypeStruct(
                (8, 12), jnp.float32, sharding=NamedSharding(m2, PartitionSpec("model", "data"))
            ),
            "b": jax.ShapeDtypeStruct(
                (12,), jnp.bfloat16, sharding=NamedSharding(m2, PartitionSpec("data"))
            ),
            "q": jax.ShapeDtypeStruct(
                (4, 8), jnp.float8_e4m3fn, sharding=NamedSharding(m2, PartitionSpec())
            ),
        },
        "step": 0,
    }
    back = snapshard.load(tmp_path / "torch", abstract)
    for k in ("w", "b", "q"):
        assert back["params"][k].sharding == abstract["params"][k].sharding
        assert _bits_np(np.asarray(back["params"][k])) == _bits_np(np.asarray(tree["params"][k]))
    assert back["step"] == 5


def test_torch_linear_weights_evaluated_in_jax(tmp_path):
    # torch's Linear stores (out, in); a JAX user reads and transposes it on the host.
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 3)
    st.save(tmp_path / "c", lin.state_dict())
    arrays = snapshard.load(tmp_path / "c")
    x = np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32)
    want = lin(torch.from_numpy(x)).detach().numpy()
    got = np.asarray(jnp.asarray(x) @ jnp.asarray(arrays["weight"]).T + arrays["bias"])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_transforms_map_jax_names_onto_torch_ones_with_transposes_and_casts(tmp_path):
    from snapshard.errors import TargetMismatchError
    from snapshard.safetensors import surgery as S

    k = np.arange(12, dtype=np.float32).reshape(3, 4)
    snapshard.save(tmp_path / "c", {"params": {"dense": {"kernel": k, "bias": k[0]}}, "step": 3})
    jax_to_torch = S.chain(
        S.transpose(r"params/.*/kernel"),
        S.rename(r"params/(\w+)/kernel", r"\1.weight"),
        S.rename(r"params/(\w+)/bias", r"\1.bias"),
    )
    target = {
        "dense.weight": torch.zeros(4, 3, dtype=torch.bfloat16),
        "dense.bias": torch.zeros(4),
        "step": 0,
    }
    out = st.load(tmp_path / "c", target, transform=jax_to_torch)
    assert out is target and out["step"] == 3
    assert torch.equal(target["dense.weight"], torch.from_numpy(k.T.copy()).to(torch.bfloat16))
    assert torch.equal(target["dense.bias"], torch.from_numpy(k[0].copy()))
    # transposed twice is the saved layout again
    twice = S.chain(jax_to_torch, S.transpose(r"dense\.weight"))
    plain = {"dense.weight": torch.zeros(3, 4)}
    st.load(tmp_path / "c", plain, transform=twice)
    assert torch.equal(plain["dense.weight"], torch.from_numpy(k))
    with pytest.raises(
        TargetMismatchError, match=r"shape \(4, 3\) in the checkpoint \(transposed\)"
    ):
        st.load(tmp_path / "c", {"dense.weight": torch.zeros(3, 4)}, transform=jax_to_torch)
    flat = S.chain(jax_to_torch, S.reshape(r"dense\.weight", [12]))
    with pytest.raises(TargetMismatchError, match="rename, transpose and cast"):
        st.load(tmp_path / "c", {"dense.weight": torch.zeros(12)}, transform=flat)
    with pytest.raises(ValueError, match="needs a target"):
        st.load(tmp_path / "c", transform=jax_to_torch)


def test_the_jax_trained_mlp_example_gives_the_same_outputs_in_torch(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(
        [sys.executable, os.path.join(root, "examples", "jax_to_torch.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    diff = float(p.stdout.split(":")[-1])
    assert diff < 1e-5
