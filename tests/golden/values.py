"""The trees of the golden v1 corpus, rebuilt from fixed seeds.

`make_v1.py` saves these trees; `tests/test_golden_v1.py` rebuilds them and compares what the
stored checkpoints load to them, so expected values are recomputed here, never stored. Every
function is deterministic: NumPy's `default_rng` with fixed seeds, raw bit patterns for the
floating-point types (NaN payloads and subnormals included), and typed PRNG keys wrapped
from NumPy-generated key data where their values matter.

Changing anything here invalidates the corpus: the tests would then fail against files
written by the format-v1 library, which cannot be regenerated once that library is gone.
"""

from __future__ import annotations

import contextlib
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

MESH_SHAPE = (2, 4)
MESH_AXES = ("data", "model")

Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class Box:
    """A registered pytree node (not a container the format knows by name)."""

    low: Any
    high: Any


def _register_box() -> None:
    import jax

    with contextlib.suppress(ValueError):  # already registered in this process
        jax.tree_util.register_dataclass(Box, data_fields=["low", "high"], meta_fields=[])


# ---- NumPy arrays --------------------------------------------------------------------------

# (name, dtype) of the host arrays, one per dtype the format names.
HOST_DTYPES: list[tuple[str, Any]] = [
    ("bool", np.bool_),
    ("int8", np.int8),
    ("int16", np.int16),
    ("int32", np.int32),
    ("int64", np.int64),
    ("uint8", np.uint8),
    ("uint16", np.uint16),
    ("uint32", np.uint32),
    ("uint64", np.uint64),
    ("float16", np.float16),
    ("float32", np.float32),
    ("float64", np.float64),
    ("complex64", np.complex64),
    ("complex128", np.complex128),
    ("bfloat16", ml_dtypes.bfloat16),
    ("float8_e4m3fn", ml_dtypes.float8_e4m3fn),
    ("float8_e5m2", ml_dtypes.float8_e5m2),
    ("int4", ml_dtypes.int4),
    ("uint4", ml_dtypes.uint4),
]

_SUB_BYTE_RANGE = {"int4": (-8, 8), "uint4": (0, 16)}


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An array of `dtype`: random bit patterns for byte-sized types (every float bit pattern,
    NaNs included), random valid values for bool and the sub-byte integer types."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.name in _SUB_BYTE_RANGE:
        lo, hi = _SUB_BYTE_RANGE[dt.name]
        return rng.integers(lo, hi, size=shape, dtype=np.int8).astype(dt)
    raw = rng.integers(0, 256, size=n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def special_floats(dtype: Any) -> np.ndarray:
    """NaN, the infinities, -0.0 and a few ordinary values in `dtype` (those it can hold)."""
    values = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1.0, -2.5, 1e-3]
    if np.dtype(dtype) == np.dtype(ml_dtypes.float8_e4m3fn):
        values = [np.nan, -0.0, 0.0, 1.0, -2.5, 448.0]  # no infinities
    return np.array(values, dtype=np.float64).astype(dtype)


def host_arrays() -> dict[str, np.ndarray]:
    """One array per dtype (shape (3, 5): odd sizes), plus special values, 0-d and empty arrays."""
    rng = np.random.default_rng(20240101)
    out = {name: random_array(rng, (3, 5), dt) for name, dt in HOST_DTYPES}
    for name in ("float16", "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
        out[f"special_{name}"] = special_floats(dict(HOST_DTYPES)[name])
    out["special_complex64"] = np.array(
        [complex(np.nan, 1.0), complex(-0.0, np.inf), complex(1.5, -0.0)], dtype=np.complex64
    )
    out["cube_int16"] = random_array(rng, (2, 3, 7), np.int16)
    out["vector_uint64_big"] = np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64)
    out["zero_d_float32"] = np.array(3.25, dtype=np.float32)
    out["zero_d_bool"] = np.array(True)
    out["zero_d_bfloat16"] = np.array(-1.5, dtype=ml_dtypes.bfloat16)
    out["zero_d_int4"] = np.array(-3, dtype=ml_dtypes.int4)
    out["empty_float32"] = np.zeros((0, 3), dtype=np.float32)
    out["empty_int16"] = np.zeros((4, 0, 2), dtype=np.int16)
    out["empty_1d_bool"] = np.zeros((0,), dtype=np.bool_)
    return out


def numpy_scalars() -> dict[str, np.generic]:
    return {
        "float32": np.float32(1.5),
        "float64": np.float64(-0.0),
        "float16_nan": np.float16(np.nan),
        "int64": np.int64(-(2**62)),
        "uint64": np.uint64(2**64 - 1),
        "uint8": np.uint8(200),
        "int8": np.int8(-128),
        "bool": np.bool_(True),
        "complex64": np.complex64(complex(1.0, -2.0)),
        "bfloat16": ml_dtypes.bfloat16(3.5),
        "float8_e4m3fn": ml_dtypes.float8_e4m3fn(-0.5),
        "int4": ml_dtypes.int4(7),
    }


def python_values() -> dict[str, Any]:
    return {
        "int_zero": 0,
        "int_negative": -12345,
        "int_huge": 2**70 + 12345,
        "int_huge_negative": -(2**65) + 3,
        "float": 0.1,
        "float_nan": float("nan"),
        "float_inf": float("inf"),
        "float_neg_inf": float("-inf"),
        "float_neg_zero": -0.0,
        "float_subnormal": 5e-324,
        "true": True,
        "false": False,
        "str": "plain",
        "str_empty": "",
        "str_unicode": "héllo ☃ 日本語 🎉 \u0000 \n\t\"'\\",
        "none": None,
    }


# ---- JAX values -------------------------------------------------------------------------------

# name -> (shape, dtype, PartitionSpec entries) of the arrays sharded over the 2 x 4 mesh.
SHARDED: dict[str, tuple[tuple[int, ...], Any, tuple[Any, ...]]] = {
    "rows_f32": ((8, 5), np.float32, ("model", None)),
    "cols_bf16": ((3, 8), ml_dtypes.bfloat16, (None, "model")),
    "grid_f32": ((4, 12), np.float32, ("data", "model")),
    "flat_int32": ((16, 3), np.int32, (("data", "model"), None)),
    "cube_f16": ((4, 6, 5), np.float16, ("model", "data", None)),
    "replicated_f32": ((7, 3), np.float32, ()),
    "data_only_uint8": ((6, 7), np.uint8, ("data", None)),
    "vector_bool": ((8,), np.bool_, ("model",)),
}


def sharded_globals() -> dict[str, np.ndarray]:
    """The global values of the sharded arrays, as NumPy."""
    rng = np.random.default_rng(31337)
    return {name: random_array(rng, shape, dt) for name, (shape, dt, _) in SHARDED.items()}


def key_data() -> dict[str, np.ndarray]:
    """Key data (uint32) of the arrays of typed PRNG keys and of the raw keys."""
    rng = np.random.default_rng(4242)
    return {
        "threefry_split": rng.integers(0, 2**32, size=(8, 2), dtype=np.uint32),
        "rbg_split": rng.integers(0, 2**32, size=(3, 4), dtype=np.uint32),
        "raw_pair": rng.integers(0, 2**32, size=(2,), dtype=np.uint32),
    }


def mesh(devices: Any = None) -> Any:
    import jax
    from jax.sharding import Mesh

    devs = np.array(jax.devices() if devices is None else devices)
    return Mesh(devs.reshape(MESH_SHAPE), MESH_AXES)


def sharded_arrays(m: Any) -> dict[str, Any]:
    """The sharded jax.Arrays on mesh `m`, built from every process's addressable slices
    (so the same code serves one process and several)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    g = sharded_globals()
    out = {}
    for name, (shape, _, spec) in SHARDED.items():
        s = NamedSharding(m, PartitionSpec(*spec))
        out[name] = jax.make_array_from_callback(shape, s, lambda idx, x=g[name]: x[idx])
    return out


def prng_keys(m: Any | None = None) -> dict[str, Any]:
    """Typed PRNG keys (threefry and rbg) and raw uint32 keys. With a mesh, the array of
    threefry keys is sharded over it; otherwise it lives on one device."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    kd = key_data()
    threefry = jax.random.wrap_key_data(kd["threefry_split"], impl="threefry2x32")
    if m is not None:
        threefry = jax.jit(lambda k: k, out_shardings=NamedSharding(m, PartitionSpec(MESH_AXES)))(
            threefry
        )
    return {
        "threefry": jax.random.key(7, impl="threefry2x32"),
        "rbg": jax.random.key(11, impl="rbg"),
        "threefry_split": threefry,
        "rbg_split": jax.random.wrap_key_data(kd["rbg_split"], impl="rbg"),
        "raw_seed": jax.random.PRNGKey(3),
        "raw_pair": jax.numpy.asarray(kd["raw_pair"]),
    }


def containers() -> dict[str, Any]:
    """Every container kind the format names, nested, including empty ones."""
    _register_box()
    rng = np.random.default_rng(99)
    return {
        "nested": {"a": {"b": {"c": np.arange(5, dtype=np.int16)}}, "leaf": 1},
        "int_keys": {0: "zero", 1: np.float32(1.0), 7: {3: [np.int8(-1)]}},
        "list": [1, "two", np.array([3.0]), [None, [False]]],
        "tuple": (np.uint16(9), ("x", ()), 2.5),
        "namedtuple": Pair(first=random_array(rng, (2, 3), np.float32), second=Pair(1, "b")),
        "node": Box(low=np.array([-1, 0], dtype=np.int32), high=3),
        "empty_dict": {},
        "empty_list": [],
        "empty_tuple": (),
        "key with / and . and ünïcode": np.array([1], dtype=np.uint8),
    }


def single_tree(m: Any) -> dict[str, Any]:
    """The full tree of `single/` and `objstore/` (8 devices, one process)."""
    return {
        "sharded": sharded_arrays(m),
        "host": host_arrays(),
        "scalars": numpy_scalars(),
        "python": python_values(),
        "keys": prng_keys(m),
        "containers": containers(),
    }


def multiprocess_tree(m: Any) -> dict[str, Any]:
    """The tree of `multiprocess/`: sharded arrays spanning both processes, host values."""
    return {
        "sharded": sharded_arrays(m),
        "keys": {"threefry_split": prng_keys(m)["threefry_split"]},
        "host": {k: host_arrays()[k] for k in ("float32", "bfloat16", "int4", "empty_float32")},
        "step": 17,
        "name": "multiprocess",
    }


MANAGER_STEPS = (100, 200)


def manager_tree(step: int) -> dict[str, Any]:
    """The tree saved by the CheckpointManager at `step` (host values only: small)."""
    rng = np.random.default_rng(1000 + step)
    return {
        "params": {
            "w": random_array(rng, (4, 3), np.float32),
            "b": random_array(rng, (3,), ml_dtypes.bfloat16),
        },
        "opt": [np.int64(step), random_array(rng, (5,), np.float16)],
        "step": step,
    }


def manager_metrics(step: int) -> dict[str, Any]:
    return {"loss": 1.0 / step, "accuracy": step / 1000.0, "note": f"step {step}"}


def incremental_tree(m: Any) -> dict[str, Any]:
    """The tree of an incremental step on top of `single_tree` (its base): the sharded
    arrays, keys and containers as in the base (saved as references to the base's files),
    the host arrays replaced by the manager's step-200 tree (written by the step itself)."""
    return {**single_tree(m), "host": manager_tree(200)}
