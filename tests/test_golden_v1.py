"""The golden corpus of format v1: checkpoints written by the format-v1 library, which every
later version must read bit-exactly.

The files are in tests/golden/v1/ (written once by tests/golden/make_v1.py); the values
they must hold are rebuilt by tests/golden/values.py. Only the public API is used (load,
metadata, CheckpointManager, the command line, the exceptions of snapshard.errors), so these
tests keep their meaning across changes of the on-disk format. The corpus is never written:
damage is done to copies in tmp_path, and object-store checks upload a copy to memory://.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
from golden import values
from snapshard.cli import main as cli
from snapshard.errors import (
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
)

GOLDEN = Path(__file__).parent / "golden" / "v1"
SINGLE = GOLDEN / "single"
MULTI = GOLDEN / "multiprocess"
MANAGER = GOLDEN / "manager"
OBJSTORE = GOLDEN / "objstore"
MARKER = "COMMITTED"


# ---- expected values ----------------------------------------------------------------------


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def expected(tree: Any, *, plain: bool) -> Any:
    """What loading `tree` gives: jax.Arrays as NumPy (typed keys stay key arrays); with
    `plain` (no target), namedtuples and registered nodes as dicts of their fields."""
    if isinstance(tree, dict):
        return {k: expected(v, plain=plain) for k, v in tree.items()}
    if isinstance(tree, list):
        return [expected(v, plain=plain) for v in tree]
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        fields = {f: expected(getattr(tree, f), plain=plain) for f in type(tree)._fields}
        return fields if plain else type(tree)(**fields)
    if isinstance(tree, tuple):
        return tuple(expected(v, plain=plain) for v in tree)
    if isinstance(tree, values.Box):
        fields = {"low": expected(tree.low, plain=plain), "high": expected(tree.high, plain=plain)}
        return fields if plain else values.Box(**fields)
    if is_key(tree):
        return tree
    if isinstance(tree, jax.Array):
        return np.asarray(tree)
    return tree


def numpy_target(tree: Any) -> Any:
    """A target asking for every leaf as NumPy (keys as unsharded key arrays), same structure."""

    def leaf(x: Any) -> Any:
        if is_key(x):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        if isinstance(x, jax.Array | np.ndarray):
            return np.zeros(x.shape, x.dtype)
        if isinstance(x, np.generic):
            return x.dtype.type(0)
        return x  # Python values: a value of any kind asks for the saved value

    return jax.tree_util.tree_map(leaf, tree)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        np.ascontiguousarray(a).view(np.uint8).tobytes()
        == np.ascontiguousarray(b).view(np.uint8).tobytes()
    )


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Same structure, same container and leaf types, and bit-identical leaves."""
    where = where or "(root)"
    if isinstance(want, dict):
        assert type(got) is dict, f"{where}: {type(got).__name__}, expected dict"
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, got))}"
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
        return
    if isinstance(want, list | tuple | values.Box):
        assert type(got) is type(want), f"{where}: {type(got).__name__}, expected {type(want)}"
        if isinstance(want, values.Box):
            assert_same(got.low, want.low, f"{where}/low")
            assert_same(got.high, want.high, f"{where}/high")
            return
        assert len(got) == len(want), f"{where}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}/{i}")
        return
    if is_key(want):
        assert is_key(got), f"{where}: {type(got).__name__}, expected a typed key array"
        assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want)), where
        assert got.shape == want.shape, where
        assert same_bytes(
            np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(want))
        ), where
        return
    if isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, f"{where}: {type(got).__name__}, expected np.ndarray"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{where}: {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"
        )
        assert same_bytes(got, want), f"{where}: values differ"
        return
    if isinstance(want, np.generic):
        assert type(got) is type(want), f"{where}: {type(got).__name__}, expected {type(want)}"
        assert same_bytes(np.asarray(got), np.asarray(want)), f"{where}: {got!r} != {want!r}"
        return
    assert type(got) is type(want), f"{where}: {type(got).__name__}, expected {type(want)}"
    if isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want) or (
            math.isnan(got) and math.isnan(want)
        ), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_shards(x: jax.Array, want: np.ndarray, sharding: NamedSharding, where: str) -> None:
    """x is on `sharding`, and every addressable shard holds exactly want's bytes there."""
    assert isinstance(x, jax.Array) and x.sharding == sharding, f"{where}: {x.sharding}"
    assert x.dtype == want.dtype and x.shape == want.shape, where
    for s in x.addressable_shards:
        assert same_bytes(np.asarray(s.data), want[s.index]), f"{where}: shard {s.index}"


@pytest.fixture(scope="module")
def mesh8() -> Mesh:
    return values.mesh()


@pytest.fixture(scope="module")
def single_tree(mesh8):
    return values.single_tree(mesh8)


@pytest.fixture(scope="module")
def multi_tree(mesh8):
    return values.multiprocess_tree(mesh8)


def other_mesh() -> Mesh:
    """A mesh of another shape than the (2, 4) the arrays were saved from."""
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


# Sharded-array leaf -> its PartitionSpec on other_mesh().
RESHARD = {
    "rows_f32": P(("a", "b"), None),
    "cols_bf16": P(None, "a"),
    "grid_f32": P("b", "a"),
    "flat_int32": P("a"),
    "cube_f16": P(None, "b", None),
    "replicated_f32": P(),
    "data_only_uint8": P("b"),
    "vector_bool": P("a"),
}


def run_cli(capsys, *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = cli([*args[:1], "--json", "-q", *args[1:]])
    return rc, json.loads(capsys.readouterr().out)


def upload(directory: Path, *, skip: tuple[str, ...] = ()) -> str:
    """Every file under `directory`, uploaded under its relative name to a fresh memory://
    prefix; returns the prefix's URL."""
    from snapshard.storage.objstore import ObjectStorage

    url = f"memory://golden-{uuid.uuid4().hex[:12]}/run/ckpt"
    storage = ObjectStorage(url)
    try:
        for f in sorted(directory.rglob("*")):
            name = f.relative_to(directory).as_posix()
            if f.is_file() and name not in skip:
                storage.client.put(name, f.read_bytes())
    finally:
        storage.close()
    return url


# ---- the corpus is there ------------------------------------------------------------------


def test_corpus_is_complete_and_small():
    for d in (SINGLE, MULTI, MANAGER / "100", MANAGER / "200", OBJSTORE):
        assert (d / "manifest.json").is_file(), d
        assert list((d / "data").glob("*.bin")), d
    assert (OBJSTORE / MARKER).is_file() and (OBJSTORE / MARKER).stat().st_size == 0
    total = sum(f.stat().st_size for f in GOLDEN.rglob("*") if f.is_file())
    assert total < 2 << 20, total


# ---- single process -----------------------------------------------------------------------


def test_single_loads_without_target(single_tree):
    assert_same(snapshard.load(SINGLE), expected(single_tree, plain=True))


def test_single_loads_into_numpy_target(single_tree):
    out = snapshard.load(SINGLE, numpy_target(single_tree))
    assert_same(out, expected(single_tree, plain=False))
    assert type(out["containers"]["namedtuple"]) is values.Pair
    assert type(out["containers"]["node"]) is values.Box


def test_single_loads_onto_a_mesh_of_another_shape(single_tree):
    m = other_mesh()
    g = values.sharded_globals()
    host = values.host_arrays()
    keys = single_tree["keys"]["threefry_split"]
    shardings = {k: NamedSharding(m, spec) for k, spec in RESHARD.items()}
    target = {
        "sharded": {
            k: jax.ShapeDtypeStruct(g[k].shape, g[k].dtype, sharding=s)
            for k, s in shardings.items()
        },
        "host": {  # NumPy values saved from the host, restored as sharded jax.Arrays
            "cube_int16": jax.ShapeDtypeStruct(
                (2, 3, 7), np.int16, sharding=NamedSharding(m, P("b"))
            ),
            "bfloat16": jax.ShapeDtypeStruct(
                (3, 5), host["bfloat16"].dtype, sharding=NamedSharding(m, P())
            ),
        },
        "keys": {
            "threefry_split": jax.ShapeDtypeStruct(
                keys.shape, keys.dtype, sharding=NamedSharding(m, P("a"))
            )
        },
    }
    out = snapshard.load(SINGLE, target)  # a partial restore: only these leaves
    assert set(out) == {"sharded", "host", "keys"}
    for k, s in shardings.items():
        assert_shards(out["sharded"][k], g[k], s, k)
    assert_shards(out["host"]["cube_int16"], host["cube_int16"], NamedSharding(m, P("b")), "cube")
    assert_shards(out["host"]["bfloat16"], host["bfloat16"], NamedSharding(m, P()), "bf16")
    k = out["keys"]["threefry_split"]
    assert is_key(k) and k.sharding == NamedSharding(m, P("a"))
    assert same_bytes(np.asarray(jax.random.key_data(k)), values.key_data()["threefry_split"])


def test_single_metadata(single_tree):
    meta = snapshard.metadata(SINGLE)
    g = values.sharded_globals()
    for name, (shape, dtype, spec) in values.SHARDED.items():
        a = meta["sharded"][name]
        assert (a.kind, a.shape, a.dtype) == ("array", shape, np.dtype(dtype).name), name
        assert a.nbytes == g[name].nbytes
        assert a.sharding["type"] == "NamedSharding", a.sharding
        assert a.sharding["mesh"] == dict(zip(values.MESH_AXES, values.MESH_SHAPE, strict=True))
        saved_spec = [list(s) if isinstance(s, list | tuple) else s for s in a.sharding["spec"]]
        want_spec = [list(s) if isinstance(s, tuple) else s for s in spec]
        assert saved_spec[: len(want_spec)] == want_spec
        assert all(s is None for s in saved_spec[len(want_spec) :])
    for name, x in values.host_arrays().items():
        a = meta["host"][name]
        assert (a.kind, a.shape, a.dtype, a.nbytes) == ("array", x.shape, x.dtype.name, x.nbytes)
        assert a.sharding == {"type": "host"}
    for name, x in values.numpy_scalars().items():
        a = meta["scalars"][name]
        assert (a.kind, a.shape, a.dtype) == ("scalar", (), x.dtype.name), name
    for name, v in values.python_values().items():
        got = meta["python"][name].value
        assert_same(got, v, f"python/{name}")
    for name, impl, shape in (
        ("threefry", "threefry2x32", ()),
        ("rbg", "rbg", ()),
        ("threefry_split", "threefry2x32", (8,)),
        ("rbg_split", "rbg", (3,)),
    ):
        a = meta["keys"][name]
        assert (a.kind, a.key_impl, a.shape) == ("prng_key", impl, shape), name
    assert (meta["keys"]["raw_seed"].kind, meta["keys"]["raw_seed"].dtype) == ("array", "uint32")
    c = meta["containers"]
    assert c["empty_dict"] == {} and c["empty_list"] == [] and c["empty_tuple"] == ()
    assert set(c["namedtuple"]) == {"first", "second"} and set(c["node"]) == {"low", "high"}
    assert set(c["int_keys"]) == {0, 1, 7}


# ---- several processes --------------------------------------------------------------------


def test_multiprocess_loads_without_target(multi_tree):
    assert_same(snapshard.load(MULTI), expected(multi_tree, plain=True))


def test_multiprocess_loads_onto_one_process_of_another_shape(multi_tree):
    m = other_mesh()
    g = values.sharded_globals()
    target = numpy_target(multi_tree)
    target["sharded"] = {
        k: jax.ShapeDtypeStruct(g[k].shape, g[k].dtype, sharding=NamedSharding(m, s))
        for k, s in RESHARD.items()
    }
    out = snapshard.load(MULTI, target)
    for k, s in RESHARD.items():
        assert_shards(out["sharded"][k], g[k], NamedSharding(m, s), k)
    rest = {k: v for k, v in expected(multi_tree, plain=False).items() if k != "sharded"}
    assert_same({k: v for k, v in out.items() if k != "sharded"}, rest)


def test_multiprocess_was_written_by_two_processes(capsys):
    rc, doc = run_cli(capsys, "info", str(MULTI))
    assert rc == 0 and doc["process_count"] == 2, doc
    assert doc["version"] == "1"  # the format version as text ("2.1" for 2.1)


# ---- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["single", "multiprocess", "manager/100", "manager/200", "objstore"]
)
def test_cli_verify_finds_every_golden_checkpoint_intact(capsys, name):
    rc, doc = run_cli(capsys, "verify", str(GOLDEN / name))
    assert rc == 0 and doc["ok"] is True and doc["problem"] is None, doc
    assert doc["bytes_checked"] == doc["bytes"] > 0


# ---- CheckpointManager --------------------------------------------------------------------


def test_manager_restores_both_steps_with_metrics(tmp_path):
    root = tmp_path / "manager"
    shutil.copytree(MANAGER, root)  # a manager may tidy its root: never the corpus itself
    with snapshard.CheckpointManager(root) as mgr:
        assert mgr.all_steps() == list(values.MANAGER_STEPS)
        assert mgr.latest_step() == values.MANAGER_STEPS[-1]
        for step in values.MANAGER_STEPS:
            assert_same(dict(mgr.metrics(step)), values.manager_metrics(step), f"metrics {step}")
            want = values.manager_tree(step)
            assert_same(mgr.restore(step), want)
            assert_same(mgr.restore(step, target=numpy_target(want)), want)
        assert_same(mgr.restore(), values.manager_tree(values.MANAGER_STEPS[-1]))


# ---- object store -------------------------------------------------------------------------


def test_objstore_copy_loads_from_memory_store(single_tree):
    url = upload(OBJSTORE)
    assert_same(snapshard.load(url), expected(single_tree, plain=True))
    meta = snapshard.metadata(url)
    assert meta["sharded"]["grid_f32"].shape == (4, 12)
    m = other_mesh()
    g = values.sharded_globals()
    s = NamedSharding(m, RESHARD["grid_f32"])
    out = snapshard.load(
        url, {"sharded": {"grid_f32": jax.ShapeDtypeStruct((4, 12), np.float32, sharding=s)}}
    )
    assert_shards(out["sharded"]["grid_f32"], g["grid_f32"], s, "grid_f32")


def test_objstore_copy_verifies_in_memory_store(capsys):
    rc, doc = run_cli(capsys, "verify", upload(OBJSTORE))
    assert rc == 0 and doc["ok"] is True, doc


def test_objstore_copy_without_marker_is_not_a_checkpoint():
    url = upload(OBJSTORE, skip=(MARKER,))
    with pytest.raises(CheckpointNotFoundError):
        snapshard.load(url)
    with pytest.raises(CheckpointNotFoundError):
        snapshard.metadata(url)


# ---- damaged copies -----------------------------------------------------------------------


@pytest.fixture
def damaged(tmp_path) -> Path:
    """A copy of the single-process checkpoint, to damage."""
    d = tmp_path / "single"
    shutil.copytree(SINGLE, d)
    return d


def data_files(d: Path) -> list[Path]:
    files = sorted((d / "data").glob("*.bin"))
    assert files
    return files


def test_flipped_byte_is_a_checksum_mismatch(damaged, capsys):
    for f in data_files(damaged):
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x01
        f.write_bytes(bytes(b))
    with pytest.raises(ChecksumMismatchError):
        snapshard.load(damaged)
    rc, doc = run_cli(capsys, "verify", str(damaged))
    assert rc == 1 and doc["ok"] is False, doc


def test_truncated_data_file_is_corrupt(damaged, capsys):
    f = data_files(damaged)[0]
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        snapshard.load(damaged)
    rc, doc = run_cli(capsys, "verify", str(damaged))
    assert rc == 1 and doc["ok"] is False, doc


def test_missing_manifest_is_no_checkpoint(damaged):
    (damaged / "manifest.json").unlink()
    with pytest.raises(CheckpointNotFoundError):
        snapshard.load(damaged)
    with pytest.raises(CheckpointNotFoundError):
        snapshard.metadata(damaged)


def test_unknown_manifest_version_is_refused_by_name(damaged, capsys):
    path = damaged / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["version"] = 99
    path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match=r"version.*99|99.*version"):
        snapshard.load(damaged)
    with pytest.raises(CorruptCheckpointError, match="99"):
        snapshard.metadata(damaged)
    rc, doc = run_cli(capsys, "verify", str(damaged))
    assert rc == 1 and doc["ok"] is False and "99" in doc["problem"]["message"], doc


def test_truncated_manifest_is_corrupt(damaged):
    path = damaged / "manifest.json"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError):
        snapshard.load(damaged)
    with pytest.raises(CorruptCheckpointError):
        snapshard.metadata(damaged)
