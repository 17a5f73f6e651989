"""Lazy model surgery against eager NumPy: each transform alone and composed, on meshes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
import snapshard.safetensors as sst
from snapshard.safetensors import surgery as S
from snapshard.safetensors.materialize import reshape_source_box
from st_files import write_single

from conftest import mesh

LAYERS, EXPERTS = 2, 8


def source(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(LAYERS):
        for p, shape in (
            ("q", (16, 8)),
            ("k", (4, 8)),
            ("v", (4, 8)),
            ("gate", (12, 8)),
            ("up", (12, 8)),
        ):
            out[f"model.layers.{i}.{p}.weight"] = rng.standard_normal(shape).astype(np.float32)
        for e in range(EXPERTS):
            out[f"model.layers.{i}.experts.{e}.w1.weight"] = rng.standard_normal((6, 8)).astype(
                np.float32
            )
    return out


@pytest.fixture(scope="module")
def src():
    return source()


@pytest.fixture(scope="module")
def path(src, tmp_path_factory):
    return write_single(tmp_path_factory.mktemp("surgery") / "model.safetensors", src)


L0 = "model.layers.0"

# name -> (transform, output name, eager reference from the source dict)
CASES = {
    "rename": (
        S.rename(r"model\.layers\.(\d+)\.(.*)", r"layers_\1/\2"),
        "layers_0/q.weight",
        lambda s: s[f"{L0}.q.weight"],
    ),
    "fuse": (
        S.fuse(r"(.*)\.(?P<part>gate|up)\.weight", r"\1.gate_up", ["gate", "up"], axis=0),
        f"{L0}.gate_up",
        lambda s: np.concatenate([s[f"{L0}.gate.weight"], s[f"{L0}.up.weight"]], 0),
    ),
    "transpose then fuse on the last axis": (
        S.chain(
            S.transpose(r".*\.(q|k|v)\.weight"),
            S.fuse(r"(.*)\.(?P<part>q|k|v)\.weight", r"\1.qkv", ["q", "k", "v"], axis=-1),
        ),
        f"{L0}.qkv",
        lambda s: np.concatenate([s[f"{L0}.{p}.weight"].T for p in "qkv"], axis=-1),
    ),
    "split": (
        S.split(r"(.*)\.q\.weight", [r"\1.q_a", r"\1.q_b"], [5, 11], axis=0),
        f"{L0}.q_b",
        lambda s: s[f"{L0}.q.weight"][5:],
    ),
    "repeat": (
        S.repeat(r".*\.k\.weight", 4, axis=0, block=2),
        f"{L0}.k.weight",
        lambda s: np.repeat(s[f"{L0}.k.weight"].reshape(2, 2, 8), 4, axis=0).reshape(16, 8),
    ),
    "stack": (
        S.stack(r"(.*)\.experts\.(?P<i>\d+)\.w1\.weight", r"\1.experts.w1"),
        f"{L0}.experts.w1",
        lambda s: np.stack([s[f"{L0}.experts.{e}.w1.weight"] for e in range(EXPERTS)]),
    ),
    "transpose": (
        S.transpose(r".*\.up\.weight"),
        f"{L0}.up.weight",
        lambda s: s[f"{L0}.up.weight"].T,
    ),
    "reshape": (
        S.reshape(r".*\.gate\.weight", (3, 4, 8)),
        f"{L0}.gate.weight",
        lambda s: s[f"{L0}.gate.weight"].reshape(3, 4, 8),
    ),
    "cast": (
        S.cast(r".*\.v\.weight", np.float16),
        f"{L0}.v.weight",
        lambda s: s[f"{L0}.v.weight"].astype(np.float16),
    ),
}


def composed():
    """A Llama/Mixtral-style pipeline: every kind of transform, stacked on each other."""
    t = S.chain(
        S.repeat(r".*\.k\.weight", 4, axis=0, block=2),
        S.repeat(r".*\.v\.weight", 4, axis=0, block=2),
        S.fuse(r"(.*)\.(?P<part>q|k|v)\.weight", r"\1.qkv", ["q", "k", "v"], axis=0),
        S.transpose(r".*\.qkv"),
        S.reshape(r".*\.qkv", (8, 3, 16)),
        S.stack(r"model\.layers\.(?P<i>\d+)\.qkv", "qkv"),
        S.stack(r"(.*)\.experts\.(?P<i>\d+)\.w1\.weight", r"\1.w1"),
        S.stack(r"model\.layers\.(?P<i>\d+)\.w1", "w1"),
        S.cast("w1", np.float16),
        S.drop(r".*\.(gate|up)\.weight"),
    )

    def ref(s):
        qkv = []
        for i in range(LAYERS):
            rep = {
                p: np.repeat(s[f"model.layers.{i}.{p}.weight"].reshape(2, 2, 8), 4, 0).reshape(
                    16, 8
                )
                for p in "kv"
            }
            fused = np.concatenate([s[f"model.layers.{i}.q.weight"], rep["k"], rep["v"]], 0)
            qkv.append(fused.T.reshape(8, 3, 16))
        w1 = np.stack(
            [
                np.stack([s[f"model.layers.{i}.experts.{e}.w1.weight"] for e in range(EXPERTS)])
                for i in range(LAYERS)
            ]
        )
        return {"qkv": np.stack(qkv), "w1": w1.astype(np.float16)}

    return t, ref


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_transform_matches_numpy_whole(src, path, case):
    t, name, ref = CASES[case]
    out = sst.load(path, transform=t)
    assert np.array_equal(out[name], ref(src)) and out[name].dtype == ref(src).dtype


def _shardings(shape, m):
    """A few shardings of every axis that divides, on the 2x4 mesh."""
    specs = [P()]
    for a, n in enumerate(shape):
        for axis, size in (("data", 2), ("model", 4), (("data", "model"), 8)):
            if n % size == 0:
                spec = [None] * len(shape)
                spec[a] = axis
                specs.append(P(*spec))
    if len(shape) >= 2 and shape[0] % 2 == 0 and shape[-1] % 4 == 0:
        specs.append(P("data", *[None] * (len(shape) - 2), "model"))
    return [NamedSharding(m, s) for s in specs]


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_transform_matches_numpy_on_every_sharding(src, path, case):
    t, name, ref = CASES[case]
    want = ref(src)
    m = mesh(2, 4)
    for sharding in _shardings(want.shape, m):
        out = sst.load(
            path,
            {name: jax.ShapeDtypeStruct(want.shape, want.dtype, sharding=sharding)},
            transform=t,
        )
        for s in out[name].addressable_shards:
            assert np.array_equal(np.asarray(s.data), want[s.index]), (sharding.spec, s.index)


def test_composed_transforms_match_numpy(src, path):
    t, ref = composed()
    want = ref(src)
    whole = sst.load(path, transform=t)
    assert sorted(whole) == ["qkv", "w1"]
    for k in want:
        assert np.array_equal(whole[k], want[k]) and whole[k].dtype == want[k].dtype
    m = mesh(2, 4)
    for k in want:
        for sharding in _shardings(want[k].shape, m):
            out = sst.load(
                path,
                {k: jax.ShapeDtypeStruct(want[k].shape, want[k].dtype, sharding=sharding)},
                transform=t,
            )
            for s in out[k].addressable_shards:
                assert np.array_equal(np.asarray(s.data), want[k][s.index]), (k, sharding.spec)


def test_stacked_experts_sharded_over_experts_read_only_their_tensors(src, path):
    """Each device box holds one expert: it reads exactly that expert's bytes, once."""
    t = S.stack(r"(.*)\.experts\.(?P<i>\d+)\.w1\.weight", r"\1.experts.w1")
    m = mesh(2, 4)
    sharding = NamedSharding(m, P(("data", "model")))
    stats = snapshard.ReadStats()
    name = f"{L0}.experts.w1"
    out = sst.load(
        path,
        {name: jax.ShapeDtypeStruct((EXPERTS, 6, 8), np.float32, sharding=sharding)},
        transform=t,
        stats=stats,
    )
    assert stats.bytes_read == stats.bytes_needed == EXPERTS * 6 * 8 * 4
    assert stats.chunks_touched == EXPERTS
    for s in out[name].addressable_shards:
        e = s.index[0].start
        assert np.array_equal(np.asarray(s.data)[0], src[f"{L0}.experts.{e}.w1.weight"])


def test_transform_errors_are_clear(path):
    with pytest.raises(ValueError, match="no tensor matches"):
        sst.load(path, transform=S.transpose(r"nothing\..*"))
    with pytest.raises(ValueError, match=r"parts \['gate'\] found, \['gate', 'up'\] expected"):
        sst.load(path, transform=S.fuse(r"(.*)\.(?P<part>gate)\.weight", r"\1.gu", ["gate", "up"]))
    with pytest.raises(snapshard.TargetMismatchError, match="differ off axis"):
        sst.load(
            path, transform=S.fuse(r"(.*)\.(?P<part>q|k)\.weight", r"\1.qk", ["q", "k"], axis=1)
        )
    with pytest.raises(ValueError, match="already taken"):
        sst.load(path, transform=S.rename(r"model\.layers\.\d+\.(.*)", r"\1"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dims=st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4),
    data=st.data(),
)
def test_reshape_boxes_are_read_exactly_or_whole_per_group(dims, data):
    """reshape_source_box + the slicing it returns equals slicing the eager reshape."""
    src_shape = tuple(dims)
    n = int(np.prod(src_shape))
    factors = [f for f in range(1, n + 1) if n % f == 0]
    a = data.draw(st.sampled_from(factors))
    b = data.draw(st.sampled_from([f for f in factors if (n // a) % f == 0]))
    out_shape = (a, b, n // a // b)
    start = np.array([data.draw(st.integers(0, s - 1)) for s in out_shape])
    stop = np.array(
        [data.draw(st.integers(int(lo) + 1, s)) for lo, s in zip(start, out_shape, strict=False)]
    )
    x = np.arange(n).reshape(src_shape)
    s_start, s_stop, mid, where = reshape_source_box(src_shape, out_shape, start, stop)
    read = x[tuple(slice(int(p), int(q)) for p, q in zip(s_start, s_stop, strict=False))]
    got = read.reshape(mid)[where]
    want = x.reshape(out_shape)[
        tuple(slice(int(p), int(q)) for p, q in zip(start, stop, strict=False))
    ]
    assert np.array_equal(got, want)


def test_the_llama_example_loads_and_matches_its_numpy_reference(tmp_path):
    root = Path(__file__).parent.parent
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    run = subprocess.run(
        [sys.executable, str(root / "examples" / "hf_llama_load.py"), "--dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "matches the eager NumPy reference: True" in run.stdout
