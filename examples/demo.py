"""snapshard demo: train a tiny model on 8 CPU devices with checkpoints, resume, reshard.

    python examples/demo.py [--dir DIR] [--steps 30] [--every 5]

The training state holds the parameters, the optimizer state, a PRNG key, the step and the
position of the data iterator, so a run that is killed at any moment and started again
resumes from the newest complete checkpoint and ends with bit-identical parameters.
At the end the final state is restored onto a different mesh and into NumPy, and compared.

Multi-process (one process per "host", here all on one machine):
    python examples/demo.py --processes 4 --process-id I --port 12355   (for I in 0..3)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time

# 8 simulated CPU devices per run (split over the processes), before JAX is imported.
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--processes", type=int, default=1)
_known, _ = _pre.parse_known_args()
os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={8 // _known.processes}"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import snapshard  # noqa: E402

IN, HIDDEN, BATCH = 32, 256, 64


def say(*args: object) -> None:
    if jax.process_index() == 0:
        print(*args, flush=True)


def batch_at(position: int) -> tuple[np.ndarray, np.ndarray]:
    """The data iterator: batch number `position` of a deterministic stream."""
    rng = np.random.default_rng(position)
    x = rng.standard_normal((BATCH, IN), dtype=np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)
    return x, y


def shardings(mesh: Mesh) -> dict:
    """Where each part of the training state lives on `mesh`."""

    def s(*spec: object) -> NamedSharding:
        return NamedSharding(mesh, P(*spec))

    params = {"w1": s(None, "model"), "b1": s("model"), "w2": s("model", None), "b2": s()}
    return {"params": params, "opt": {"m": params, "v": params, "count": s()}, "key": s()}


def init_arrays() -> dict:
    k1, k2, key = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) * 0.1,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) * 0.1,
        "b2": jnp.zeros(1),
    }
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {
        "params": params,
        "opt": {"m": zeros, "v": zeros, "count": jnp.zeros((), jnp.int32)},
        "key": key,
    }


def initial_state(mesh: Mesh) -> dict:
    return {**jax.jit(init_arrays, out_shardings=shardings(mesh))(), "step": 0, "data_position": 0}


def abstract_state(mesh: Mesh) -> dict:
    """The restore target: shapes, dtypes and shardings of the state, no data."""
    arrays = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(init_arrays),
        shardings(mesh),
    )
    return {**arrays, "step": 0, "data_position": 0}


@jax.jit
def train_step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """One Adam step on an MLP, with input noise drawn from the state's PRNG key."""
    key, noise_key = jax.random.split(state["key"])

    def loss_fn(p: dict) -> jax.Array:
        xn = x + 0.01 * jax.random.normal(noise_key, x.shape)
        h = jnp.tanh(xn @ p["w1"] + p["b1"])
        return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    count = state["opt"]["count"] + 1
    m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, state["opt"]["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, state["opt"]["v"], grads)
    c = count.astype(jnp.float32)
    params = jax.tree_util.tree_map(
        lambda p, m, v: p - 1e-2 * (m / (1 - 0.9**c)) / (jnp.sqrt(v / (1 - 0.999**c)) + 1e-8),
        state["params"], m, v,
    )  # fmt: skip
    return {"params": params, "opt": {"m": m, "v": v, "count": count}, "key": key}, loss


def digest(state: dict) -> str:
    """A hash of every parameter byte, the same whatever the sharding."""
    h = hashlib.sha256()
    for name in sorted(state["params"]):
        x = state["params"][name]
        h.update(
            np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True)).tobytes()
        )
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "snapshard-demo"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=12355)
    args = ap.parse_args(argv)
    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process_id)
    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(2, -1), ("data", "model"))
    say(
        f"{jax.process_count()} process(es), {len(devices)} devices, mesh {dict(mesh.shape)}; checkpoints in {args.dir}"
    )

    manager = snapshard.CheckpointManager(
        args.dir, save_interval_steps=args.every, max_to_keep=args.keep
    )
    if manager.latest_step() is not None:
        t = time.perf_counter()
        state = manager.restore(target=abstract_state(mesh))
        say(
            f"resumed from step {state['step']} (data position {state['data_position']}) in {time.perf_counter() - t:.3f} s"
        )
    else:
        state = initial_state(mesh)
        say("no checkpoint yet: starting from scratch")
    data_sharding = NamedSharding(mesh, P("data"))
    loss = None
    while state["step"] < args.steps:
        x, y = batch_at(state["data_position"])
        xs = jax.make_array_from_callback(x.shape, data_sharding, lambda i, x=x: x[i])
        ys = jax.make_array_from_callback(y.shape, data_sharding, lambda i, y=y: y[i])
        arrays, loss = train_step({k: state[k] for k in ("params", "opt", "key")}, xs, ys)
        state = {**arrays, "step": state["step"] + 1, "data_position": state["data_position"] + 1}
        step = state["step"]
        if manager.should_save(step) or manager.reached_preemption(step):
            t = time.perf_counter()
            manager.save(step, state, metrics={"loss": float(loss)}, force=True)
            say(
                f"step {step:4d}  loss {float(loss):.5f}  checkpoint: training blocked {1e3 * (time.perf_counter() - t):.1f} ms"
            )
    manager.wait_until_finished()
    for step, t in sorted(manager.save_timings().items()):
        say(f"  step {step}: blocking {1e3 * t.blocking_s:.1f} ms, write {1e3 * t.write_s:.1f} ms, "
            f"commit {1e3 * t.commit_s:.1f} ms, total {1e3 * t.total_s:.1f} ms, {t.bytes_written} B written")  # fmt: skip
    say(f"committed steps: {manager.all_steps()}")
    final = digest(state)

    # Restore the newest step onto another mesh, and into NumPy, and compare.
    other = Mesh(devices.reshape(-1, 2), ("data", "model"))
    stats = snapshard.ReadStats()
    t = time.perf_counter()
    resharded = manager.restore(target=abstract_state(other), stats=stats)
    say(f"restored step {resharded['step']} onto mesh {dict(other.shape)} in {time.perf_counter() - t:.3f} s "
        f"(read {stats.read_s:.3f} s, assemble {stats.assemble_s:.3f} s, {stats.bytes_read} B read for {stats.bytes_needed} B needed)")  # fmt: skip
    assert digest(resharded) == final, "resharded restore differs"
    if jax.process_count() == 1:
        host = manager.restore()
        for name, x in state["params"].items():
            assert np.asarray(x).tobytes() == host["params"][name].tobytes(), name
        say("NumPy restore (no target) is identical too")
    manager.close()
    say(f"final parameter digest {final}; restored copies identical")
    return final


if __name__ == "__main__":
    main(sys.argv[1:])
