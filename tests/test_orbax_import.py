"""snapshard.load and snapshard.metadata on checkpoints written by orbax-checkpoint."""

from __future__ import annotations

import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
from orbax_writer import LAYOUTS, save_manager, save_pytree, state_tree

from conftest import mesh, sharded

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tensorstore")


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module")
def orbax_dirs(tmp_path_factory):
    """The state tree written by Orbax in every layout it offers."""
    root = tmp_path_factory.mktemp("orbax")
    tree = state_tree()
    return tree, {name: save_pytree(root / name, tree, name) for name in LAYOUTS}


def other_mesh_target(tree):
    """ShapeDtypeStructs on a 4x2 mesh with other specs than the saved ones."""
    m = mesh(4, 2, names=("a", "b"))

    def spec(x):
        if x.ndim == 2 and x.shape[0] % 4 == 0:
            return P("a", None)
        if x.ndim == 2 and x.shape[1] % 2 == 0:
            return P(None, "b")
        if x.ndim == 1 and x.shape[0] % 8 == 0:
            return P(("a", "b"))
        return P()

    def leaf(x):
        if isinstance(x, jax.Array | np.ndarray):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, spec(x)))
        return x

    return jax.tree_util.tree_map(leaf, tree)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loads_bit_exact_onto_another_mesh(orbax_dirs, layout):
    tree, dirs = orbax_dirs
    target = other_mesh_target(tree)
    out = snapshard.load(dirs[layout], target)
    flat_out = jax.tree_util.tree_leaves_with_path(out)
    flat_src = dict(jax.tree_util.tree_leaves_with_path(tree))
    flat_tgt = dict(jax.tree_util.tree_leaves_with_path(target))
    assert len(flat_out) == len(flat_src)
    for path, x in flat_out:
        src, tgt = flat_src[path], flat_tgt[path]
        if isinstance(tgt, jax.ShapeDtypeStruct):
            assert x.sharding == tgt.sharding, path
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                assert same_bits(jax.random.key_data(x), jax.random.key_data(src))
            else:
                assert same_bits(x, src), path
        else:
            assert x == src and type(x) is type(src), path


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loads_into_numpy_without_target(orbax_dirs, layout):
    tree, dirs = orbax_dirs
    out = snapshard.load(dirs[layout])
    p = out["params"]
    for k in ("w", "emb", "odd", "bias"):
        assert isinstance(p[k], np.ndarray) and same_bits(p[k], tree["params"][k])
    assert same_bits(p["layers"][0], tree["params"]["layers"][0])  # bool
    assert same_bits(p["layers"][1], tree["params"]["layers"][1])  # int8
    assert same_bits(out["opt"]["count"], np.asarray(tree["opt"]["count"]))  # 0-d array
    assert same_bits(out["opt"]["half"], tree["opt"]["half"])
    assert out["opt"]["empty"] == {} and out["opt"]["none"] is None
    assert same_bits(out["host_counts"], tree["host_counts"])
    assert same_bits(jax.random.key_data(out["rng"]), jax.random.key_data(tree["rng"]))
    assert out["step"] == 1000 and out["lr"] == 0.125 and out["name"] == "run-7"


def test_partial_restore_reads_only_the_target(orbax_dirs, tmp_path):
    tree, dirs = orbax_dirs
    ckpt = tmp_path / "partial"
    shutil.copytree(dirs["zarr"], ckpt)
    # Remove the data of a leaf the target omits: a partial restore must not miss it.
    for chunk in (ckpt / "params.w").iterdir():
        if not chunk.name.startswith("."):
            chunk.unlink()
    target = {"params": {"emb": other_mesh_target(tree)["params"]["emb"]}, "step": 0}
    stats = snapshard.ReadStats()
    out = snapshard.load(ckpt, target, stats=stats)
    assert same_bits(out["params"]["emb"], tree["params"]["emb"]) and out["step"] == 1000
    assert stats.bytes_read == tree["params"]["emb"].nbytes
    # Reading everything meets the missing chunks: refused, as Orbax refuses them.
    with pytest.raises(snapshard.CorruptCheckpointError, match=r"leaf 'params/w'.*missing"):
        snapshard.load(ckpt)


def test_dtype_cast_and_numpy_target(orbax_dirs):
    tree, dirs = orbax_dirs
    target = {
        "params": {
            "emb": jax.ShapeDtypeStruct((8, 12), np.float32),  # no sharding: NumPy
            "w": np.zeros((16, 24), np.float64),
        }
    }
    out = snapshard.load(dirs["ocdbt-zarr3"], target)
    emb = np.asarray(tree["params"]["emb"]).astype(np.float32)
    assert same_bits(out["params"]["emb"], emb)
    assert same_bits(out["params"]["w"], np.asarray(tree["params"]["w"]).astype(np.float64))


def test_target_mismatch_names_the_leaf(orbax_dirs):
    _, dirs = orbax_dirs
    with pytest.raises(snapshard.TargetMismatchError, match="params/w"):
        snapshard.load(dirs["ocdbt-zarr"], {"params": {"w": np.zeros((3, 3), np.float32)}})
    with pytest.raises(snapshard.TargetMismatchError, match="params/nope"):
        snapshard.load(dirs["ocdbt-zarr"], {"params": {"nope": np.zeros(3)}})


def test_metadata(orbax_dirs):
    _, dirs = orbax_dirs
    md = snapshard.metadata(dirs["ocdbt-zarr"])
    w = md["params"]["w"]
    assert w.shape == (16, 24) and w.dtype == "float32" and w.nbytes == 16 * 24 * 4
    assert w.sharding["mesh"] == {"data": 2, "model": 4}
    assert w.sharding["spec"] == ["data", "model"]
    assert w.chunks == 8  # one zarr chunk per shard
    assert md["params"]["emb"].dtype == "bfloat16" and md["params"]["odd"].chunks == 1
    assert md["host_counts"].sharding == {"type": "host"}
    assert md["rng"].dtype == "key<threefry2x32>" and md["rng"].shape == ()
    assert md["step"] == snapshard.ValueMetadata(1000)
    assert md["opt"]["empty"] == {}


def test_manager_steps_items_and_root(tmp_path):
    trees = {
        s: {"w": np.full((4, 6), s, np.float32), "b": np.arange(3, dtype=np.int64) + s}
        for s in (1, 2, 3)
    }
    root = save_manager(tmp_path / "mgr", trees)
    out = snapshard.load(root / "2")  # a step directory: its single item
    assert same_bits(out["w"], trees[2]["w"]) and same_bits(out["b"], trees[2]["b"])
    assert same_bits(snapshard.load(root / "3" / "default")["w"], trees[3]["w"])
    with pytest.raises(snapshard.CheckpointNotFoundError, match=r"CheckpointManager.*1, 2, 3"):
        snapshard.load(root)
    two = {s: {"params": {"w": t["w"]}, "opt": {"b": t["b"]}} for s, t in trees.items()}
    multi = save_manager(tmp_path / "multi", {1: two[1]}, items=("params", "opt"))
    out = snapshard.load(multi / "1")  # several items: a dict of them
    assert same_bits(out["params"]["w"], trees[1]["w"]) and same_bits(
        out["opt"]["b"], trees[1]["b"]
    )
    partial = snapshard.load(multi / "1", {"opt": {"b": np.zeros(3, np.int64)}})
    assert list(partial) == ["opt"]


def test_a_directory_that_is_neither_format_is_not_found(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    with pytest.raises(snapshard.CheckpointNotFoundError, match=r"no manifest\.json"):
        snapshard.load(tmp_path / "junk")
    with pytest.raises(snapshard.CheckpointNotFoundError):
        snapshard.metadata(tmp_path / "missing")


@pytest.mark.multiprocess
def test_each_process_reads_only_its_boxes(orbax_dirs):
    import multiproc

    tree, dirs = orbax_dirs
    w, emb = tree["params"]["w"], tree["params"]["emb"]
    for p in multiproc.run("orbax_restore.py", 2, 4, dirs["ocdbt-zarr"], timeout=120):
        r = p.result()
        assert r["ok"], f"process {p.process_id} restored wrong values"
        # Rows of w are split between the two processes; emb is replicated over them and,
        # on a filesystem (read-once off by default), read by both.
        assert r["stats"]["bytes_read"] == w.nbytes // 2 + emb.nbytes
        assert r["stats"]["bytes_from_peers"] == 0


def test_unreadable_orbax_checkpoints_say_why(orbax_dirs, tmp_path, monkeypatch):
    _, dirs = orbax_dirs
    old = tmp_path / "old"
    old.mkdir()
    (old / "checkpoint").write_bytes(b"\x81\xa1w\x01")  # the msgpack file of very old Orbax
    with pytest.raises(snapshard.SnapshardError, match="from before Orbax wrote _METADATA"):
        snapshard.load(old)
    # Without TensorStore installed, an Orbax directory is named as such.
    monkeypatch.setitem(sys.modules, "snapshard.orbax.reader", None)
    with pytest.raises(
        snapshard.SnapshardError, match=r"Orbax checkpoint; reading it needs TensorStore"
    ):
        snapshard.metadata(dirs["zarr"])


@pytest.mark.parametrize("layout", ["zarr", "zarr3"])
def test_a_missing_chunk_is_refused_not_read_as_zeros(tmp_path, layout):
    """Orbax reads a chunk missing from storage as an error; so do load, convert and verify."""
    w = np.arange(64, dtype=np.float32).reshape(8, 8) + 1
    saved = save_pytree(tmp_path / "o", {"w": sharded(w, mesh(8), "data")}, layout)
    (saved / "w" / ("3.0" if layout == "zarr" else "c/3/0")).unlink()  # rows 3 of 8 chunks
    with pytest.raises(snapshard.CorruptCheckpointError, match=r"leaf 'w'.*missing"):
        snapshard.load(saved)
    for command in (["convert", str(saved), str(tmp_path / "c")], ["verify", str(saved)]):
        run = subprocess.run(
            [sys.executable, "-m", "snapshard", *command], capture_output=True, text=True
        )
        assert run.returncode != 0 and "leaf 'w'" in run.stdout + run.stderr, run
    assert not (tmp_path / "c").exists()


def test_int_dict_keys_match_as_orbax_matches_them(tmp_path):
    """Orbax saves every dict key as text ("0"); a target's int keys (an optax state's, an
    nnx.List's) find them, as in Orbax's own restore."""
    import orbax.checkpoint as ocp

    tree = {"opt": {0: np.ones(2, np.float32), 1: np.zeros(3, np.int32)}, "l": [np.ones(1)]}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((tmp_path / "o").absolute(), tree)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    got = snapshard.load(tmp_path / "o", target)
    assert list(got["opt"]) == [0, 1]
    assert all(same_bits(got["opt"][k], tree["opt"][k]) for k in (0, 1))
    with pytest.raises(snapshard.TargetMismatchError, match=r"'opt/2' of the target"):
        snapshard.load(tmp_path / "o", {"opt": {2: target["opt"][0]}})
