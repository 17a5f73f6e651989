"""Flax NNX and linen, optax: whole objects saved and restored into abstract targets."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
from snapshard.tree import ClassesLostWarning

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
nn = pytest.importorskip("flax.linen")
train_state = pytest.importorskip("flax.training.train_state")


def explicit_mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


class MLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.l1 = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def make_state():
    model = MLP(nnx.Rngs(0, dropout=1))
    return {"model": model, "opt": nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)}


def train(state, steps=2):
    x = jnp.ones((4, 8))

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    for _ in range(steps):
        step(state["model"], state["opt"])
    return state


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def assert_same(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("how", ["eval_shape", "abstract_target"])
def test_nnx_module_optimizer_rngs_roundtrip(ckpt, how):
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        state = train(make_state())
        snapshard.save(ckpt, state)
        if how == "eval_shape":
            target = nnx.eval_shape(make_state)
    if how == "abstract_target":
        target = snapshard.abstract_target(make_state, mesh)
    with jax.set_mesh(mesh):
        out = snapshard.load(ckpt, target)
    assert type(out["model"]) is MLP and type(out["opt"]) is nnx.Optimizer
    assert isinstance(out["model"].drop.rngs, nnx.RngStream)
    assert out["model"].l1.kernel.sharding == NamedSharding(mesh, P(None, "model"))
    assert int(out["opt"].step[...]) == 2
    assert_same(nnx.state(out["model"]), nnx.state(state["model"]))
    assert_same(nnx.state(out["opt"]), nnx.state(state["opt"]))
    # The restored model trains on exactly as the original does (dropout stream included).
    with jax.set_mesh(mesh):
        train(state, 1)
        train(out, 1)
    assert_same(nnx.state(out["model"]), nnx.state(state["model"]))


def test_nnx_state_and_split(ckpt):
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(3))
        graphdef, state = nnx.split(model)
        snapshard.save(ckpt, state)
        abstract_state = nnx.state(nnx.eval_shape(lambda: MLP(nnx.Rngs(0))))
        restored = snapshard.load(ckpt, abstract_state)
    assert isinstance(restored, nnx.State)
    merged = nnx.merge(graphdef, restored)
    assert_same(nnx.state(merged), state)
    # nnx.State paths gain a trailing 'value'
    assert "l1/kernel/value" in {"/".join(map(str, p)) for p in _paths(snapshard.metadata(ckpt))}


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    else:
        yield prefix


def test_nnx_rngs_alone(ckpt):
    rngs = nnx.Rngs(0, dropout=5)
    rngs.dropout()
    rngs.dropout()
    snapshard.save(ckpt, rngs)
    out = snapshard.load(ckpt, nnx.eval_shape(lambda: nnx.Rngs(0, dropout=5)))
    assert type(out) is nnx.Rngs
    assert int(out.dropout.count[...]) == 2
    np.testing.assert_array_equal(
        jax.random.key_data(out.dropout()), jax.random.key_data(rngs.dropout())
    )


def test_keys_asked_for_as_key_data_by_orbax_recipe_come_back_typed(ckpt):
    """Orbax's recipe of a target (`to_shape_dtype_struct`) asks for a typed key as its
    uint32 key data; typed keys come back, as Orbax restores them, so that the next save
    saves keys again. A NumPy target gets the key data."""
    rngs = nnx.Rngs(0, dropout=5)
    rngs.dropout()
    snapshard.save(ckpt, nnx.state(rngs))

    def as_data(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(x)
            return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    out = snapshard.load(ckpt, jax.tree.map(as_data, nnx.state(nnx.Rngs(0, dropout=5))))
    key = out["dropout"]["key"][...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
    np.testing.assert_array_equal(
        jax.random.key_data(key), jax.random.key_data(rngs.dropout.key[...])
    )
    data = snapshard.load(ckpt, {"dropout": {"key": {"value": np.zeros(2, np.uint32)}}})
    np.testing.assert_array_equal(
        data["dropout"]["key"]["value"], jax.random.key_data(rngs.dropout.key[...])
    )


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(
            8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
        )(x)
        return nn.Dense(4)(x)


def make_train_state(rng):
    model = Dense()
    params = model.init(rng, jnp.ones((1, 3)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def test_linen_train_state_with_optax(ckpt):
    # linen's partitioning annotations are sharding constraints: they want Auto axes
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    state = jax.jit(make_train_state)(jax.random.key(0))
    grads = jax.tree_util.tree_map(jnp.ones_like, state.params)
    state = state.apply_gradients(grads=grads)
    snapshard.save(ckpt, state)
    target = snapshard.abstract_target(make_train_state, mesh, jax.random.key(0))
    kernel = target.params["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.Partitioned)
    assert kernel.value.sharding == NamedSharding(mesh, P(None, "model"))
    out = snapshard.load(ckpt, target)
    assert type(out) is train_state.TrainState
    assert type(out.opt_state[1][0]).__name__ == "ScaleByAdamState"
    assert out.params["Dense_0"]["kernel"].value.sharding.spec == P(None, "model")
    assert int(out.step) == 1
    assert_same(out, state)
    # the static fields (apply_fn, tx) come from the target
    assert out.tx is not None and out.apply_fn is not None


def test_no_target_warns_naming_the_first_class(ckpt):
    state = jax.jit(make_train_state)(jax.random.key(0))
    snapshard.save(ckpt, state)
    with pytest.warns(ClassesLostWarning, match=r"the root was saved as .*TrainState .*target"):
        out = snapshard.load(ckpt)
    assert isinstance(out, dict) and set(out) == {"step", "params", "opt_state"}
    snapshard.save(ckpt.with_name("plain"), {"a": np.zeros(3), "b": [1, (2, 3)]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        snapshard.load(ckpt.with_name("plain"))


def test_no_target_warns_for_namedtuple(ckpt):
    snapshard.save(ckpt, {"opt": optax.adam(1e-3).init({"w": jnp.zeros(3)})})
    with pytest.warns(ClassesLostWarning, match=r"'opt/0' was saved as ScaleByAdamState"):
        snapshard.load(ckpt)
