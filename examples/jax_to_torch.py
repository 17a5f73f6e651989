"""A JAX-trained MLP, saved with snapshard, evaluated in PyTorch with the same outputs.

JAX's dense layers store kernels as (in, out) under `params/<layer>/kernel`; torch's Linear
stores weights as (out, in) under `<layer>.weight`. The surgery transforms of
snapshard.safetensors map one onto the other while loading: only names and a transpose.

    python examples/jax_to_torch.py [DIR]
"""

from __future__ import annotations

import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch

import snapshard
import snapshard.torch as st
from snapshard.safetensors import surgery as S

SIZES = (8, 32, 4)


def init(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "params": {
            "hidden": {
                "kernel": jax.random.normal(k1, SIZES[:2]) * 0.3,
                "bias": jnp.zeros(SIZES[1]),
            },
            "out": {"kernel": jax.random.normal(k2, SIZES[1:]) * 0.3, "bias": jnp.zeros(SIZES[2])},
        }
    }


def forward(state: dict, x: jax.Array) -> jax.Array:
    p = state["params"]
    h = jax.nn.relu(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return h @ p["out"]["kernel"] + p["out"]["bias"]


def train(steps: int = 50) -> tuple[dict, np.ndarray]:
    x = jax.random.normal(jax.random.key(1), (64, SIZES[0]))
    y = jnp.sin(x[:, : SIZES[2]])
    state = init(jax.random.key(0))
    loss = lambda s: jnp.mean((forward(s, x) - y) ** 2)  # noqa: E731
    step = jax.jit(lambda s: jax.tree.map(lambda a, g: a - 0.05 * g, s, jax.grad(loss)(s)))
    for _ in range(steps):
        state = step(state)
    return state, np.asarray(x)


# JAX names -> torch names, kernels transposed to torch's (out, in).
JAX_TO_TORCH = S.chain(
    S.transpose(r"params/.*/kernel"),
    S.rename(r"params/(\w+)/kernel", r"\1.weight"),
    S.rename(r"params/(\w+)/bias", r"\1.bias"),
)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(SIZES[0], SIZES[1])
        self.out = torch.nn.Linear(SIZES[1], SIZES[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


def main(directory: str) -> float:
    state, x = train()
    path = os.path.join(directory, "mlp")
    snapshard.save(path, state, overwrite=True)

    model = MLP()
    st.load(path, model.state_dict(), transform=JAX_TO_TORCH)  # in place into the model
    # Bit-exact weights: torch's weight is JAX's kernel transposed.
    kernel = np.asarray(state["params"]["hidden"]["kernel"])
    assert np.array_equal(model.hidden.weight.detach().numpy(), kernel.T)
    with torch.no_grad():
        out_torch = model(torch.from_numpy(np.array(x))).numpy()
    out_jax = np.asarray(forward(state, jnp.asarray(x)))
    diff = float(np.max(np.abs(out_torch - out_jax)))
    print(f"max |torch - jax| over {out_jax.size} outputs: {diff:.2e}")
    assert diff < 1e-5, diff  # the same weights; only float rounding of two matmul kernels
    return diff


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
