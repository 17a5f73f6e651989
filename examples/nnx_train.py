"""Train a sharded Flax NNX model on a Grain pipeline with snapshard's CheckpointManager.

    python examples/nnx_train.py --dir /tmp/nnx-run --steps 12             # train, saving every 4
    python examples/nnx_train.py --dir /tmp/nnx-run --steps 20             # resume at the newest step
    python examples/nnx_train.py --dir /tmp/nnx-run --steps 24 --mesh 4x2  # resume onto another mesh

Killed at any moment (kill -9 included), a rerun resumes from the newest committed step:
model, optimizer, dropout stream and data position, so that the parameters after N steps are
bit-identical to those of a run never interrupted (on the same mesh). It prints a digest of
the final parameters to compare. Runs on CPU with 8 simulated devices.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard

FEATURES, HIDDEN, BATCH, RECORDS = 16, 64, 8, 512


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        shard_out = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        shard_in = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("model", None))
        self.up = nnx.Linear(FEATURES, HIDDEN, kernel_init=shard_out, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, 1, kernel_init=shard_in, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.drop(nnx.gelu(self.up(x))))


def init_state() -> dict:
    model = Model(nnx.Rngs(params=0, dropout=1))
    return {"model": model, "opt": nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)}


class Records(grain.sources.RandomAccessDataSource):
    """A synthetic regression set: x ~ N(0, 1), y = sin(sum(x))."""

    def __len__(self) -> int:
        return RECORDS

    def __repr__(self) -> str:  # Grain checks the source of a restored state by its repr
        return f"Records({RECORDS}, features={FEATURES})"

    def __getitem__(self, i: int) -> dict:
        x = np.random.default_rng(i).standard_normal(FEATURES).astype(np.float32)
        return {"x": x, "y": np.sin(x.sum(keepdims=True))}


def data_loader() -> grain.DataLoader:
    sampler = grain.samplers.IndexSampler(
        num_records=RECORDS,
        shard_options=grain.sharding.ShardOptions(
            shard_index=jax.process_index(), shard_count=jax.process_count(), drop_remainder=True
        ),
        shuffle=True,
        seed=7,
        num_epochs=None,
    )
    return grain.DataLoader(
        data_source=Records(),
        sampler=sampler,
        operations=[grain.transforms.Batch(batch_size=BATCH, drop_remainder=True)],
        worker_count=0,
    )


@nnx.jit
def train_step(model: Model, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(m: Model) -> jax.Array:
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss


def digest(model: Model) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="checkpoint directory (steps under it)")
    p.add_argument("--steps", type=int, default=12, help="train up to this step")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--mesh", default="2x4", help="data x model devices, e.g. 2x4 or 4x2")
    args = p.parse_args(argv)
    data, model_axis = (int(n) for n in args.mesh.split("x"))
    mesh = jax.make_mesh((data, model_axis), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    batch_sharding = NamedSharding(mesh, P("data"))

    with (
        jax.set_mesh(mesh),
        snapshard.CheckpointManager(
            args.dir, save_interval_steps=args.save_every, max_to_keep=2
        ) as mgr,
    ):
        # The data iterator is a leaf of its own: saved as its position, one per process
        # (each process reads its own shard), and restored into this process's iterator.
        loader = iter(data_loader())
        start = mgr.latest_step()
        if start is None:
            state, start = init_state(), 0
        else:
            # The target: abstract NNX objects whose shardings are on this mesh.
            target = {"train": nnx.eval_shape(init_state), "data": loader}
            state = mgr.restore(start, target=target)["train"]
            print(f"resumed at step {start} on mesh {args.mesh}")
        loss = float("nan")  # nothing left to train when resumed at --steps or beyond
        for step in range(start + 1, args.steps + 1):
            batch = jax.device_put(next(loader), batch_sharding)
            loss = float(train_step(state["model"], state["opt"], batch["x"], batch["y"]))
            if mgr.should_save(step) or step == args.steps:
                mgr.save(step, {"train": state, "data": loader}, metrics={"loss": loss}, force=True)
        mgr.wait_until_finished()
    print(f"step {max(start, args.steps)} loss {loss:.6f} params {digest(state['model'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
