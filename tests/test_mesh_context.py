"""Saves and restores inside `jax.set_mesh`, explicit-axis meshes and abstract-mesh targets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if not hasattr(jax, "set_mesh"):
    pytest.skip("needs jax.set_mesh (JAX 0.7 and later)", allow_module_level=True)

from jax.sharding import AxisType, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import snapshard
from snapshard import TargetMismatchError
from snapshard.jax import arrays as jax_arrays
from snapshard.jax.arrays import (
    cpu_donation_keeps_memory,
    key_array,
    outside_context_mesh,
    resolve_target_sharding,
)


def explicit_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def test_donation_probe_under_set_mesh(monkeypatch):
    monkeypatch.setattr(jax_arrays, "_cpu_donation_safe", None)
    with jax.set_mesh(explicit_mesh()):
        assert cpu_donation_keeps_memory() in (True, False)


def test_save_and_load_inside_set_mesh(ckpt):
    mesh = explicit_mesh()
    with jax.set_mesh(mesh):
        x = jax.device_put(np.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("data", None)))
        keys = jax.random.split(jax.random.key(1), 4)
        sharded_keys = jax.device_put(keys, NamedSharding(mesh, P("model")))
        tree = {"x": x, "k": jax.random.key(0), "ks": sharded_keys}
        snapshard.save(ckpt, tree)
        target = {
            "x": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=x.sharding),
            "k": jax.random.key(0),
            "ks": sharded_keys,
        }
        out = snapshard.load(ckpt, target)
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x))
    assert out["ks"].sharding == sharded_keys.sharding
    np.testing.assert_array_equal(jax.random.key_data(out["ks"]), jax.random.key_data(keys))
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(tree["k"]))


@pytest.mark.parametrize("in_context", [False, True])
def test_key_array_on_any_sharding(in_context):
    mesh = explicit_mesh()
    data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 8)))
    shardings = [
        NamedSharding(mesh, P("model")),
        NamedSharding(mesh, P()),
        SingleDeviceSharding(jax.devices()[5]),
        None,
    ]
    for sharding in shardings:
        if in_context:
            with jax.set_mesh(mesh):
                keys = key_array(data, "threefry2x32", sharding)
        else:
            keys = key_array(data, "threefry2x32", sharding)
        assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
        assert keys.shape == (8,)
        if sharding is not None:
            assert keys.sharding.is_equivalent_to(sharding, 1)
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(keys)), data)


def test_outside_context_mesh_clears_it():
    with jax.set_mesh(explicit_mesh()):
        with outside_context_mesh():
            assert jax.sharding.get_abstract_mesh().empty
        assert not jax.sharding.get_abstract_mesh().empty


def abstract_sharding(mesh, *spec):
    return NamedSharding(mesh.abstract_mesh, P(*spec))


def test_resolve_target_sharding():
    mesh = explicit_mesh()
    s = abstract_sharding(mesh, None, "model")
    concrete = NamedSharding(mesh, P("data"))
    assert resolve_target_sharding(concrete) is concrete
    assert resolve_target_sharding(None) is None
    single = SingleDeviceSharding(jax.devices()[0])
    assert resolve_target_sharding(single) is single
    with jax.set_mesh(mesh):
        r = resolve_target_sharding(s)
    assert r.mesh == mesh and r.spec == P(None, "model")
    r = resolve_target_sharding(s, mesh)
    assert r.mesh == mesh and r.spec == P(None, "model")
    with pytest.raises(TargetMismatchError, match=r"leaf 'w'.*jax.set_mesh\(mesh\).*mesh="):
        resolve_target_sharding(s, leaf="w")
    other = jax.make_mesh((4, 2), ("data", "model"))
    with pytest.raises(TargetMismatchError, match=r"data=2, model=4.*mesh= has \(data=4"):
        resolve_target_sharding(s, other)
    with pytest.raises(TargetMismatchError, match="concrete"):
        resolve_target_sharding(s, mesh.abstract_mesh)


def test_load_abstract_mesh_target(ckpt):
    mesh = explicit_mesh()
    w = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    snapshard.save(ckpt, {"w": w, "k": jax.random.key(7)})
    target = {
        "w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=abstract_sharding(mesh, "data")),
        "k": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=abstract_sharding(mesh)),
    }
    with pytest.raises(TargetMismatchError, match="AbstractMesh"):
        snapshard.load(ckpt, target)
    with jax.set_mesh(mesh):
        a = snapshard.load(ckpt, target)
    b = snapshard.load(ckpt, target, mesh=mesh)
    for out in (a, b):
        assert out["w"].sharding == NamedSharding(mesh, P("data"))
        np.testing.assert_array_equal(np.asarray(out["w"]), w)
        assert out["k"].sharding.mesh == mesh
        np.testing.assert_array_equal(
            jax.random.key_data(out["k"]), jax.random.key_data(jax.random.key(7))
        )


def test_eval_shape_under_set_mesh_target(ckpt):
    mesh = explicit_mesh()

    def init():
        return {"w": jnp.zeros((8, 4), out_sharding=NamedSharding(mesh, P("data", "model")))}

    with jax.set_mesh(mesh):
        state = jax.jit(init)()
        state = {"w": state["w"] + jnp.arange(32.0).reshape(8, 4)}
        snapshard.save(ckpt, state)
        abstract = jax.eval_shape(init)
        assert isinstance(abstract["w"].sharding.mesh, jax.sharding.AbstractMesh)
        out = snapshard.load(ckpt, abstract)
    assert out["w"].sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(state["w"]))
