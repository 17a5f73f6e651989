"""Save and load on one process with 8 CPU devices: leaf kinds, dtypes, resharding, partial
restore, casts."""

from __future__ import annotations

import collections
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
from snapshard import ReadOptions
from snapshard.dtypes import NAME_TO_DTYPE

from conftest import mesh, sharded

Point = collections.namedtuple("Point", "x y")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    kernel: jax.Array
    bias: jax.Array


def random_bytes(shape, dtype, seed=0):
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).view(dt).reshape(shape)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", sorted(NAME_TO_DTYPE))
def test_every_dtype_round_trips_bit_exact_from_numpy(ckpt, name):
    dt = NAME_TO_DTYPE[name]
    if dt.itemsize == 1 and name not in ("bool", "int8", "uint8") and not name.startswith("float8"):
        # Sub-byte types: only their valid values have a defined byte pattern.
        x = (
            np.arange(-2, 6).astype(dt)
            if "int" in name and not name.startswith("u")
            else np.arange(6).astype(dt)
        )
        x = x[: max(2, len(x))].reshape(-1, 2)
    elif name == "bool":
        x = np.random.default_rng(1).integers(0, 2, (5, 3)).astype(bool)
    else:
        x = random_bytes((5, 3), dt)
    snapshard.save(ckpt, {"x": x, "s": x.reshape(-1)[0]})
    out = snapshard.load(ckpt)
    assert same_bits(out["x"], x)
    assert isinstance(out["s"], np.generic) and same_bits(out["s"], x.reshape(-1)[0])


JAX_DTYPES = [
    "bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
    "float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "int4", "uint4", "float4_e2m1fn", "int2", "uint2",
]  # fmt: skip


@pytest.mark.parametrize("name", JAX_DTYPES)
def test_every_jax_dtype_round_trips_sharded(ckpt, name):
    dt = NAME_TO_DTYPE[name]
    m = mesh(2, 4)
    if name in ("int4", "uint4", "int2", "uint2", "float4_e2m1fn", "bool"):
        host = (np.arange(8 * 16) % 2).astype(dt).reshape(8, 16)
    else:
        host = random_bytes((8, 16), dt, seed=3)
    x = sharded(host, m, "data", "model")
    snapshard.save(ckpt, {"x": x})
    target = {
        "x": jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh(4, 2), P("model", "data"))
        )
    }
    out = snapshard.load(ckpt, target)
    assert same_bits(np.asarray(out["x"]), np.asarray(x))
    assert same_bits(snapshard.load(ckpt)["x"], np.asarray(x))


def test_every_leaf_kind_and_container(ckpt):
    m = mesh(2, 4)
    keys = jax.random.split(jax.random.key(7), 8)
    tree = {
        "layer": Layer(sharded(np.ones((8, 4), np.float32), m, "model"), jnp.zeros(4)),
        "point": Point(np.int64(3), [1.5, None]),
        "tuple": (True, "naïve ✓", -0.0, float("nan"), float("inf"), 2**70, None),
        "list": [np.arange(3), np.float16(1.25), np.bool_(True)],
        "key": jax.random.key(3),
        "rbg_key": jax.random.key(5, impl="rbg"),
        "sharded_keys": jax.device_put(keys, NamedSharding(m, P("model"))),
        "raw_key": jax.random.PRNGKey(11),
        "empty": {},
        "empty_array": np.zeros((0, 4), np.float32),
        "zero_d": jnp.float32(4.0),
    }
    snapshard.save(ckpt, tree)
    out = snapshard.load(ckpt)
    # Without a target, registered nodes and namedtuples come back as dicts.
    assert same_bits(out["layer"]["kernel"], np.ones((8, 4), np.float32))
    assert out["point"]["x"] == 3 and isinstance(out["point"]["x"], np.int64)
    assert out["point"]["y"] == [1.5, None]
    t = out["tuple"]
    assert t[0] is True and t[1] == "naïve ✓" and math.copysign(1, t[2]) == -1 and math.isnan(t[3])
    assert t[4] == math.inf and t[5] == 2**70 and t[6] is None and isinstance(t, tuple)
    assert out["empty"] == {} and out["empty_array"].shape == (0, 4)
    assert jnp.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(tree["key"]))
    assert str(jax.random.key_impl(out["rbg_key"])) == "rbg"
    assert jnp.array_equal(jax.random.key_data(out["sharded_keys"]), jax.random.key_data(keys))
    assert same_bits(out["raw_key"], np.asarray(tree["raw_key"]))
    # With a target, the target's structure and classes come back.
    target = jax.tree_util.tree_map(lambda x: x, tree)
    back = snapshard.load(ckpt, target)
    assert isinstance(back["layer"], Layer) and isinstance(back["point"], Point)
    assert back["layer"].kernel.sharding == tree["layer"].kernel.sharding
    assert back["sharded_keys"].sharding == tree["sharded_keys"].sharding
    np.testing.assert_array_equal(
        jax.random.key_data(back["sharded_keys"]), jax.random.key_data(keys)
    )
    # Keys drive the same random numbers after the round trip.
    assert jnp.array_equal(
        jax.random.normal(back["key"], (3,)), jax.random.normal(tree["key"], (3,))
    )


def bench_like_tree(m):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 64), dtype=np.float32)
    e = rng.standard_normal((32, 64), dtype=np.float32).astype(ml_dtypes.bfloat16)
    odd = rng.standard_normal((7, 12), dtype=np.float32)  # 7 rows: not divisible by any mesh axis
    return {
        "w": sharded(w, m, None, "model"),
        "e": sharded(e, m, None, "model"),
        "b": sharded(rng.standard_normal(64, dtype=np.float32), m),
        "odd": sharded(odd, m, None, "model"),
        "full": sharded(rng.standard_normal((16, 8), dtype=np.float32), m, "data", "model"),
    }


RESHARD_TARGETS = {
    "4x2 model-rows": lambda: (mesh(4, 2), P("model", None)),
    "8 flat": lambda: (mesh(8, names=("x",)), P("x")),
    "replicated": lambda: (mesh(2, 4), P()),
    "same": lambda: (mesh(2, 4), P(None, "model")),
}


@pytest.mark.parametrize("target_name", sorted(RESHARD_TARGETS))
def test_reshard_onto_other_meshes_bit_exact(ckpt, target_name):
    src = bench_like_tree(mesh(2, 4))
    snapshard.save(ckpt, src)
    m, spec = RESHARD_TARGETS[target_name]()

    def spec_for(x):
        axes = (list(spec) + [None] * x.ndim)[: x.ndim]
        usable = [
            a if a is None or x.shape[i] % m.shape[a] == 0 else None for i, a in enumerate(axes)
        ]
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P(*usable)))

    target = jax.tree_util.tree_map(spec_for, src)
    stats = snapshard.ReadStats()
    out = snapshard.load(ckpt, target, stats=stats)
    for k in src:
        assert out[k].sharding == target[k].sharding
        assert same_bits(np.asarray(out[k]), np.asarray(src[k])), k
    # Each needed byte is read once; verification reads at most the checksum blocks touched,
    # and these arrays are single blocks.
    assert stats.bytes_needed > 0 and stats.bytes_read >= stats.bytes_needed
    numpy_out = snapshard.load(ckpt)
    for k in src:
        assert same_bits(numpy_out[k], np.asarray(src[k]))


def test_restore_into_same_sharding_reads_exactly_what_is_needed(ckpt):
    m = mesh(2, 4)
    x = sharded(
        np.random.default_rng(0).standard_normal((256, 512), dtype=np.float32), m, None, "model"
    )
    snapshard.save(ckpt, {"x": x})
    stats = snapshard.ReadStats()
    snapshard.load(ckpt, {"x": x}, stats=stats)
    # Replicated over "data": each unique box is read once for its two devices.
    assert stats.bytes_needed == x.nbytes
    assert stats.bytes_read == stats.bytes_needed


def test_reshard_of_large_array_reads_close_to_needed(ckpt):
    m = mesh(2, 4)
    x = sharded(
        np.random.default_rng(0).standard_normal((1024, 512), dtype=np.float32), m, None, "model"
    )
    snapshard.save(ckpt, {"x": x})
    stats = snapshard.ReadStats()
    target = {
        "x": jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh(4, 2), P("model", None))
        )
    }
    out = snapshard.load(ckpt, target, stats=stats)
    assert same_bits(np.asarray(out["x"]), np.asarray(x))
    assert stats.bytes_read <= 1.05 * stats.bytes_needed


def test_manifest_bytes_equal_the_unique_bytes(ckpt):
    src = bench_like_tree(mesh(2, 4))
    snapshard.save(ckpt, src)
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    unique = sum(x.nbytes for x in src.values())
    assert doc["total_bytes"] == unique
    data = sum(f.stat().st_size for f in (ckpt / "data").iterdir())
    # Each chunk is followed by its crc32c values: 4 bytes per checksum block.
    from snapshard.format import checksum_block
    from snapshard.format.reading import read_manifest
    from snapshard.storage import LocalStorage

    with LocalStorage(ckpt) as st:
        tables = [a.chunks for a in read_manifest(st).arrays]
    blocks = sum(-(-int(n) // checksum_block(int(n))) for t in tables for n in t.nbytes)
    assert data == unique + 4 * blocks


def test_partial_restore_reads_only_named_leaves(ckpt):
    src = bench_like_tree(mesh(2, 4))
    snapshard.save(ckpt, src)
    stats = snapshard.ReadStats()
    out = snapshard.load(ckpt, {"w": np.zeros((32, 64), np.float32)}, stats=stats)
    assert list(out) == ["w"] and same_bits(out["w"], np.asarray(src["w"]))
    assert stats.bytes_needed == src["w"].nbytes


def test_dtype_cast_on_restore(ckpt):
    m = mesh(2, 4)
    x = sharded(np.linspace(-3, 3, 64, dtype=np.float32).reshape(8, 8), m, "data", "model")
    snapshard.save(ckpt, {"x": x, "i": np.arange(4, dtype=np.int32)})
    target = {
        "x": jax.ShapeDtypeStruct(
            (8, 8), jnp.bfloat16, sharding=NamedSharding(mesh(8, names=("x",)), P("x"))
        ),
        "i": np.zeros(4, np.float64),
    }
    out = snapshard.load(ckpt, target)
    assert out["x"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x).astype(ml_dtypes.bfloat16))
    assert out["i"].dtype == np.float64 and out["i"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_metadata_reads_no_data(ckpt):
    src = bench_like_tree(mesh(2, 4))
    snapshard.save(ckpt, src)
    for f in (ckpt / "data").iterdir():
        f.write_bytes(b"")  # metadata must not need them
    md = snapshard.metadata(ckpt)
    assert (
        md["w"].shape == (32, 64) and md["w"].dtype == "float32" and md["w"].nbytes == 32 * 64 * 4
    )
    assert md["w"].sharding == {
        "type": "NamedSharding",
        "num_devices": 8,
        "mesh": {"data": 2, "model": 4},
        "spec": [None, "model"],
    }
    assert md["e"].dtype == "bfloat16"


def test_a_target_key_not_saved_is_shown_the_closest_saved_names(ckpt):
    layer = {k: np.ones(2) for k in ("alpha", "beta", "bias", "delta", "gamma", "kernel")}
    snapshard.save(ckpt, {"model": {"layer_0": layer}})
    cases = {  # target: what the error shows first
        ("model", "layer_0", "kernal"): "saved beside it, closest first: model/layer_0/kernel,",
        ("modle", "layer_0", "kernel"): "closest saved leaves: model/layer_0/kernel,",
        ("xyz",): "saved beside it, closest first: model)",
    }
    for path, shown in cases.items():
        target: dict = {}
        at = target
        for k in path[:-1]:
            at = at.setdefault(k, {})
        at[path[-1]] = np.zeros(2)
        with pytest.raises(snapshard.TargetMismatchError) as e:
            snapshard.load(ckpt, target)
        assert shown in str(e.value), str(e.value)


def test_target_mismatches_are_clear(ckpt):
    snapshard.save(ckpt, {"a": {"w": np.zeros((5, 4), np.float32)}, "n": 3})
    with pytest.raises(snapshard.TargetMismatchError, match=r"'a/w' has shape \(5, 4\).*\(4, 4\)"):
        snapshard.load(ckpt, {"a": {"w": np.zeros((4, 4), np.float32)}})
    with pytest.raises(
        snapshard.TargetMismatchError, match=r"'a/v' of the target is not in the checkpoint.*a/w"
    ):
        snapshard.load(ckpt, {"a": {"v": np.zeros((5, 4), np.float32)}})
    with pytest.raises(snapshard.TargetMismatchError, match=r"subtree"):
        snapshard.load(ckpt, {"a": np.zeros((5, 4), np.float32)})
    with pytest.raises(snapshard.TargetMismatchError, match=r"'n' is a saved int value"):
        snapshard.load(ckpt, {"n": np.zeros(())})
    # A per-process value is one leaf: an empty container or a subtree there is refused
    # (an empty one restored nothing, silently), naming it
    one = ckpt.parent / "one_leaf"
    snapshard.save(one, {"loader": snapshard.PerProcess({"pos": 7}), "n": 1})
    with pytest.raises(snapshard.TargetMismatchError, match=r"empty container at 'loader', wh"):
        snapshard.load(one, {"loader": {}})
    with pytest.raises(
        snapshard.TargetMismatchError, match=r"subtree at 'loader' .*a snapshard.PerProcess value"
    ):
        snapshard.load(one, {"loader": {"pos": 0}})
    assert snapshard.load(one, {"loader": snapshard.PerProcess(None)})["loader"] == {"pos": 7}
    cut = NamedSharding(mesh(2), P("data"))  # 2 devices do not cut 5 rows
    with pytest.raises(snapshard.TargetMismatchError, match=r"leaf 'a/w': .*dimension size is 5"):
        snapshard.load(ckpt, {"a": {"w": jax.ShapeDtypeStruct((5, 4), np.float32, sharding=cut)}})


def test_unsupported_leaves_are_refused_before_anything_is_written(ckpt):
    with pytest.raises(snapshard.UnsupportedLeafError, match=r"leaf 'a/1'.*object"):
        snapshard.save(ckpt, {"a": [np.zeros(2), object()]})
    with pytest.raises(snapshard.UnsupportedLeafError, match=r"leaf 's'"):
        snapshard.save(ckpt, {"s": np.array(["text"])})
    assert not ckpt.exists()


@pytest.mark.parametrize("pieces", [0, 10**9], ids=["scratch-copies", "scatter-iovecs"])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize(
    "src_spec,dst_mesh,dst_spec",
    [
        (("data", "model"), (4, 2), ("model", "data")),
        ((None, "model"), (2, 4), ("model", None)),
        (("model", None), (8,), (None, "x")),
        (("data", None), (2, 4), (None, ("data", "model"))),
    ],
)
def test_both_read_paths_give_the_same_bits(
    ckpt, monkeypatch, pieces, verify, src_spec, dst_spec, dst_mesh
):
    from snapshard.reading import reads

    monkeypatch.setattr(reads, "_MAX_SCATTER_PIECES", pieces)
    x = random_bytes((96, 160), np.float32, seed=11)
    snapshard.save(ckpt, {"x": sharded(x, mesh(2, 4), *src_spec)})
    names = ("x",) if len(dst_mesh) == 1 else ("data", "model")
    target = jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh(*dst_mesh, names=names), P(*dst_spec))
    )
    stats = snapshard.ReadStats()
    out = snapshard.load(
        ckpt, {"x": target}, options=ReadOptions(verify=verify, max_gap=0), stats=stats
    )
    assert same_bits(np.asarray(out["x"]), x)
    if not verify:
        assert stats.bytes_read == stats.bytes_needed
