"""Loading files written by the safetensors library: NumPy, meshes, index, any storage."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
import snapshard.safetensors as sst
from snapshard.errors import CorruptCheckpointError
from snapshard.storage import LocalStorage, Storage
from st_files import reference, write_sharded, write_single

from conftest import mesh


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def jax_dtype(dt):
    # Without x64, JAX holds 64-bit integers as 32-bit ones.
    return np.dtype(jax.dtypes.canonicalize_dtype(dt))


def check_shards(x: jax.Array, ref: np.ndarray) -> None:
    want = ref.astype(jax_dtype(ref.dtype))
    for s in x.addressable_shards:
        assert same_bits(s.data, want[s.index]), s.index


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def sharded_dir(ref, tmp_path_factory):
    return write_sharded(tmp_path_factory.mktemp("st") / "model", ref)


@pytest.fixture(scope="module")
def single_file(ref, tmp_path_factory):
    return write_single(tmp_path_factory.mktemp("st") / "model.safetensors", ref)


@pytest.mark.parametrize("how", ["file", "dir", "index", "sharded-dir"])
def test_loads_to_numpy_bit_exact(ref, single_file, sharded_dir, how):
    location = {
        "file": single_file,
        "dir": single_file.parent,
        "index": sharded_dir / "model.safetensors.index.json",
        "sharded-dir": sharded_dir,
    }[how]
    out = sst.load(location)
    assert sorted(out) == sorted(ref)
    for k, v in ref.items():
        assert out[k].dtype == v.dtype and same_bits(out[k], v), k


def _spec(shape: Sequence[int], axes: Sequence[str], row: bool) -> P:
    """Shard the first (row) or last (column) axis over the mesh axes it divides."""
    if not shape:
        return P()
    dim = shape[0] if row else shape[-1]
    use = tuple(a for a in axes if dim % {"data": 2, "model": 4, "x": 8}[a] == 0)[:1]
    spec = [None] * len(shape)
    spec[0 if row else -1] = use[0] if use else None
    return P(*spec)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (8,)])
@pytest.mark.parametrize("row", [True, False], ids=["rows", "cols"])
def test_loads_onto_meshes_bit_exact(ref, sharded_dir, mesh_shape, row):
    m = mesh(*mesh_shape, names=("data", "model") if len(mesh_shape) == 2 else ("x",))
    axes = m.axis_names[::-1]
    target = {
        k: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=NamedSharding(m, _spec(v.shape, axes, row))
        )
        for k, v in ref.items()
    }
    stats = snapshard.ReadStats()
    out = sst.load(sharded_dir, target, stats=stats)
    for k, v in ref.items():
        assert out[k].sharding == target[k].sharding
        check_shards(out[k], v)
    if row:
        assert stats.bytes_read <= 1.1 * stats.bytes_needed, stats


def test_row_sharded_reads_only_what_each_device_needs(tmp_path):
    big = {"w": np.arange(256 * 64, dtype=np.float32).reshape(256, 64)}
    write_single(tmp_path / "m.safetensors", big)
    m = mesh(8, names=("x",))
    stats = snapshard.ReadStats()
    target = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=NamedSharding(m, P("x")))}
    check_shards(sst.load(tmp_path / "m.safetensors", target, stats=stats)["w"], big["w"])
    assert stats.bytes_read == stats.bytes_needed == big["w"].nbytes


def test_nested_targets_name_tensors_by_dotted_paths_and_cast(ref, single_file):
    target = {
        "embed": {"weight": np.zeros((64, 32), np.float32)},
        "layers": {"0": {"mlp": {"weight": jax.ShapeDtypeStruct((48, 32), np.float32)}}},
    }
    out = sst.load(single_file, target)
    assert same_bits(out["embed"]["weight"], ref["embed.weight"])
    assert out["layers"]["0"]["mlp"]["weight"].dtype == np.float32
    assert np.array_equal(
        out["layers"]["0"]["mlp"]["weight"], ref["layers.0.mlp.weight"].astype(np.float32)
    )


def test_a_missing_or_misshapen_target_tensor_is_named(single_file):
    with pytest.raises(snapshard.TargetMismatchError, match=r"embed\.weigth.*embed\.weight"):
        sst.load(single_file, {"embed.weigth": np.zeros((64, 32), np.float32)})
    with pytest.raises(snapshard.TargetMismatchError, match=r"embed\.weight.*\(64, 32\)"):
        sst.load(single_file, {"embed.weight": np.zeros((32, 64), np.float32)})


def test_arrays_reports_names_shapes_and_dtypes_without_reading_data(ref, sharded_dir):
    lazy = sst.arrays(sharded_dir)
    assert {k: (x.shape, x.dtype) for k, x in lazy.items()} == {
        k: (v.shape, v.dtype) for k, v in ref.items()
    }


class MemoryFiles(Storage):
    """A read-only Storage over in-memory files: no sizes, no listing (like an object store)."""

    url = "memory://test"

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.reads = 0

    def read_into(self, name, offset, buffers):
        data = self.files[name]
        want = sum(len(b) for b in buffers)
        if offset + want > len(data):
            raise CorruptCheckpointError(f"{name} is truncated")
        for b in buffers:
            b[:] = data[offset : offset + len(b)]
            offset += len(b)
        self.reads += 1

    def read_manifest(self):
        raise NotImplementedError

    def is_committed(self):
        return True

    prepare_staging = open_writer = list_staging = read_staging = None  # type: ignore[assignment]
    delete_staging_files = commit = discard_staging = delete = None  # type: ignore[assignment]


MemoryFiles.__abstractmethods__ = frozenset()


def test_any_storage_backend_serves_an_index_and_its_files(ref, sharded_dir):
    storage = MemoryFiles({p.name: p.read_bytes() for p in sharded_dir.iterdir()})
    out = sst.load(storage)
    for k, v in ref.items():
        assert same_bits(out[k], v), k
    m = mesh(2, 4)
    target = {
        "embed.weight": jax.ShapeDtypeStruct(
            (64, 32), np.float32, sharding=NamedSharding(m, P("model"))
        )
    }
    check_shards(sst.load(storage, target)["embed.weight"], ref["embed.weight"])


def test_a_truncated_file_on_a_storage_without_sizes_is_caught_at_open(sharded_dir):
    files = {p.name: p.read_bytes() for p in sharded_dir.iterdir()}
    victim = sorted(n for n in files if n.endswith(".safetensors"))[1]
    files[victim] = files[victim][:-3]
    with pytest.raises(CorruptCheckpointError, match=f"{victim}.*truncated"):
        sst.load(MemoryFiles(files))


def test_local_storage_objects_are_accepted(ref, single_file):
    out = sst.load(LocalStorage(single_file.parent))
    assert same_bits(out["embed.weight"], ref["embed.weight"])
