"""Trust nothing read back, format 2.1: each damage below is refused by `load` with a
SnapshardError naming the file or leaf, and `snapshard verify` agrees (exit 1, not 0 or 2).

Damage is done with every checksum re-forged where one covers it, so that the check meant is
the one reached: verify's coverage of compressed chunks, referenced checkpoints behind
symbolic links or not committed, data and record files of another save of the same layout,
chunks moved inside their file, decoding errors, record bounds and strict JSON types.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import snapshard
from snapshard import SaveOptions
from snapshard.checksum import crc32c
from snapshard.cli import main as cli
from snapshard.errors import SnapshardError
from snapshard.format import records as rec
from snapshard.format.binding import name_key
from snapshard.format.reading import read_manifest
from snapshard.storage import LocalStorage

RNG = np.random.default_rng(36)


def tree(shift: int = 0) -> dict[str, Any]:
    """Arrays of several chunks' worth, a key and Python values (`shift` changes every
    array's values, not the layout)."""
    import jax

    return {
        "w": (np.arange(60_000, dtype=np.float32) % 97 + shift).reshape(300, 200),
        "ids": np.arange(50_000, dtype=np.int64) % 7 + shift,
        "h16": (np.arange(20_000, dtype=np.float16) + shift),
        "mask": np.arange(9_000) % 3 == shift % 3,
        "key": jax.random.key(3 + shift),
        "step": 7,
        "name": "run",
    }


def verify(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = cli(["verify", str(path), "--json"])
    return code, json.loads(capsys.readouterr().out)


def assert_refused(path: Path, capsys: pytest.CaptureFixture[str], *names: str) -> str:
    """load and verify both refuse `path` cleanly; the load's message names `names`."""
    with pytest.raises(SnapshardError) as e:
        snapshard.load(path)
    message = str(e.value)
    for n in names:
        assert n in message, (n, message)
    code, doc = verify(path, capsys)
    assert code == 1 and doc["ok"] is False, doc
    assert doc["problem"]["message"], doc
    return message


def forge_manifest(path: Path, edit: Any) -> None:
    """Edit manifest.json (a dict `edit(doc)` changes) and recompute its own checksum."""
    p = path / "manifest.json"
    doc = json.loads(p.read_bytes())
    edit(doc)
    raw = json.dumps(doc, separators=(",", ":")).encode()
    at = raw.index(b'"checksum":"') + len(b'"checksum":"')
    raw = raw[:at] + b"00000000" + raw[at + 8 :]
    p.write_bytes(raw[:at] + f"{crc32c(raw):08x}".encode() + raw[at + 8 :])


def leaf_number(path: Path, name: str) -> int:
    doc = json.loads((path / "manifest.json").read_bytes())
    return next(i for i, x in enumerate(doc["leaves"]) if x["path"] == [name])


def forge_record(path: Path, leaf: str, field: str, value: Any) -> None:
    """Set `field` of the first record of `leaf` (a function of the old value, or a value),
    with the segment's and the record file's checksums recomputed."""
    a = leaf_number(path, leaf)
    (idx,) = (path / "index").glob("*.idx")
    buf = bytearray(idx.read_bytes())
    entry = rec.decode_entries(bytes(buf[rec.directory_offset(a) : rec.directory_offset(a + 1)]))
    entry = entry.copy()
    off, count = int(entry[0]["offset"]), int(entry[0]["count"])
    ndim = len(json.loads((path / "manifest.json").read_bytes())["leaves"][a]["shape"])
    dt = rec.record_dtype(ndim)
    records = np.frombuffer(bytes(buf[off : off + count * dt.itemsize]), dt).copy()
    old = int(records[0][field])
    records[0][field] = value(old) if callable(value) else value
    buf[off : off + count * dt.itemsize] = records.tobytes()
    salt = name_key(f"index/{idx.name}")
    entry[0]["crc"] = rec.segment_crc(records.tobytes(), 0, a, salt)
    buf[rec.directory_offset(a) : rec.directory_offset(a + 1)] = entry.tobytes()
    idx.write_bytes(bytes(buf))

    def fix(doc: dict[str, Any]) -> None:
        doc["processes"]["record_crc32c"] = f"{crc32c(bytes(buf)):08x}"

    forge_manifest(path, fix)


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    snapshard.save(tmp_path / "plain", tree(), options=SaveOptions(writers=1))
    return tmp_path / "plain"


@pytest.fixture
def incremental(tmp_path: Path) -> Path:
    """`parent/step` refers to `parent/base` (all arrays but `w`)."""
    parent = tmp_path / "parent"
    snapshard.save(parent / "base", tree(), options=SaveOptions(hashes=True, writers=1))
    changed = {**tree(), "w": tree(1)["w"]}
    snapshard.save(parent / "step", changed, base=parent / "base", options=SaveOptions(writers=1))
    refs = json.loads((parent / "step" / "manifest.json").read_bytes())["refs"]
    assert any(r and r["checkpoint"] == "base" for r in refs)
    return parent / "step"


# ---- 1. verify of compressed checkpoints --------------------------------------------------


@pytest.mark.parametrize("compression", ["zstd", "zstd+shuffle"])
def test_a_fresh_compressed_checkpoint_verifies_clean(tmp_path, capsys, compression) -> None:
    snapshard.save(tmp_path / "z", tree(), options=SaveOptions(compression=compression, writers=1))
    doc = json.loads((tmp_path / "z" / "manifest.json").read_bytes())
    assert doc["codecs"], doc.get("codecs")
    code, out = verify(tmp_path / "z", capsys)
    assert code == 0 and out["ok"], out


def test_compressed_chunks_that_share_bytes_are_found_by_verify(tmp_path, capsys) -> None:
    snapshard.save(tmp_path / "z", tree(), options=SaveOptions(compression="zstd", writers=1))
    table = read_manifest(LocalStorage(tmp_path / "z")).leaf_by_path()[("ids",)].chunks
    forge_record(tmp_path / "z", "mask", "offset", int(table.offset[0]))  # onto ids' blocks
    code, out = verify(tmp_path / "z", capsys)
    assert code == 1 and "belong to both" in out["problem"]["message"], out


# ---- 2. referenced checkpoints behind symbolic links -------------------------------------


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_referenced_checkpoint_that_is_a_symlink_is_refused(incremental, capsys, where) -> None:
    parent = incremental.parent
    elsewhere = parent.parent / "elsewhere" if where == "outside" else parent / "copy"
    shutil.move(parent / "base", elsewhere)
    os.symlink(elsewhere, parent / "base")
    message = assert_refused(incremental, capsys, "symbolic link")
    assert "base" in message


# ---- 3. every data file bound to its save -------------------------------------------------


def test_a_data_file_of_another_save_renamed_into_place_is_refused(tmp_path, plain, capsys):
    snapshard.save(tmp_path / "other", tree(), options=SaveOptions(writers=1))
    (mine,) = (plain / "data").iterdir()
    (theirs,) = (tmp_path / "other" / "data").iterdir()
    assert mine.stat().st_size == theirs.stat().st_size
    shutil.copy(theirs, mine)
    assert_refused(plain, capsys, mine.name)


def test_a_record_file_of_another_save_renamed_into_place_is_refused(tmp_path, plain, capsys):
    snapshard.save(tmp_path / "other", tree(), options=SaveOptions(writers=1))
    (mine,) = (plain / "index").glob("*.idx")
    (theirs,) = (tmp_path / "other" / "index").glob("*.idx")
    shutil.copy(theirs, mine)
    raw = mine.read_bytes()
    forge_manifest(plain, lambda d: d["processes"].update(record_crc32c=f"{crc32c(raw):08x}"))
    assert_refused(plain, capsys, mine.name)


def test_chunks_swapped_inside_their_file_are_refused(tmp_path, capsys) -> None:
    """Two chunks of the same size, each with its own checksums, swap places: every chunk
    and its checksums still agree, but not with where they lie."""
    path = tmp_path / "two"
    snapshard.save(
        path, {"a": np.arange(5000.0), "b": -np.arange(5000.0)}, options=SaveOptions(writers=1)
    )
    m = read_manifest(LocalStorage(path))
    (ta, tb) = (leaf.chunks for leaf in m.arrays)
    span = int(ta.crc_offset[0]) + 4 * -(-int(ta.nbytes[0]) // int(ta.block[0])) - int(ta.offset[0])
    a0, b0 = int(ta.offset[0]), int(tb.offset[0])
    (f,) = (path / "data").iterdir()
    raw = bytearray(f.read_bytes())
    first, second = bytes(raw[a0 : a0 + span]), bytes(raw[b0 : b0 + span])
    raw[a0 : a0 + span], raw[b0 : b0 + span] = second, first
    f.write_bytes(bytes(raw))
    assert_refused(path, capsys, f.name)


def test_a_base_file_of_another_save_is_refused_through_the_reference(
    tmp_path, incremental, capsys
):
    snapshard.save(tmp_path / "other", tree(), options=SaveOptions(hashes=True, writers=1))
    (mine,) = (incremental.parent / "base" / "data").iterdir()
    (theirs,) = (tmp_path / "other" / "data").iterdir()
    shutil.copy(theirs, mine)
    assert_refused(incremental, capsys, mine.name)


# ---- 4. references to a base that is not committed ----------------------------------------


@pytest.mark.parametrize("damage", ["deleted", "garbage", "staging"])
def test_a_reference_to_a_base_that_is_not_committed_is_refused(incremental, capsys, damage):
    base = incremental.parent / "base"
    if damage == "deleted":
        (base / "manifest.json").unlink()
    elif damage == "garbage":
        (base / "manifest.json").write_bytes(b'{"format": "snapshard", "vers')
    else:  # the base is only a save that has not committed
        base.rename(base.with_name("base.snapshard-tmp"))
    assert_refused(incremental, capsys, "'base'", "references")


def test_a_reference_to_a_file_the_base_does_not_list_is_refused(incremental, capsys) -> None:
    def grow(doc: dict[str, Any]) -> None:
        r = next(r for r in doc["refs"] if r)
        r["size"] += 1

    forge_manifest(incremental, grow)
    assert_refused(incremental, capsys, "'base'", "bytes")


# ---- 5. every decoding error a SnapshardError naming file and leaf ------------------------


def _set_leaf(path: Path, leaf: str, **fields: Any) -> None:
    a = leaf_number(path, leaf)
    forge_manifest(path, lambda d: d["leaves"][a].update(fields))


def test_an_array_leaf_edited_to_per_process_names_the_leaf(plain, capsys) -> None:
    a = leaf_number(plain, "w")

    def edit(doc: dict[str, Any]) -> None:
        doc["leaves"][a] = {"path": ["w"], "kind": "per_process"}
        doc["total_bytes"] -= 300 * 200 * 4  # consistent, so that the leaf's check is reached

    forge_manifest(plain, edit)
    assert_refused(plain, capsys, "'w'", "per process")


def test_an_unknown_prng_implementation_names_the_leaf(plain, capsys) -> None:
    _set_leaf(plain, "key", key_impl="bogus")
    assert_refused(plain, capsys, "'key'", "bogus")


@pytest.mark.parametrize("dtype", ["object", "float128", "<i1"])
def test_an_unknown_stored_dtype_names_the_leaf(plain, capsys, dtype) -> None:
    _set_leaf(plain, "ids", dtype=dtype)
    assert_refused(plain, capsys, "'ids'", dtype, str(plain))


@pytest.mark.parametrize("damage", ["loop", "file"])
def test_verify_reports_a_broken_data_directory_as_damage(plain, capsys, damage) -> None:
    shutil.rmtree(plain / "data")
    if damage == "loop":
        os.symlink(plain / "data", plain / "data")
    else:
        (plain / "data").write_bytes(b"not a directory")
    assert_refused(plain, capsys, "data")


def test_unknown_record_flag_bits_are_named_as_such(plain, capsys) -> None:
    forge_record(plain, "ids", "flags", lambda f: f | 1 << 20)
    message = assert_refused(plain, capsys, "'ids'", "unknown flag bits 0x100000", ".idx")
    assert "codec none" not in message


def test_more_records_than_the_manifest_counts_names_the_leaf(tmp_path, capsys) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(jax.devices()), ("d",))
    cut = jax.device_put(np.arange(64.0).reshape(16, 4), NamedSharding(mesh, PartitionSpec("d")))
    path = tmp_path / "cut"
    snapshard.save(path, {"cut": cut, "other": np.ones(3)}, options=SaveOptions(writers=1))
    a = leaf_number(path, "cut")
    count = json.loads((path / "manifest.json").read_bytes())["leaves"][a]["chunk_count"]
    assert count > 1
    _set_leaf(path, "cut", chunk_count=count - 1)
    assert_refused(
        path, capsys, "'cut'", f"{count} chunk records found, the manifest says {count - 1}"
    )


def test_an_array_whose_records_are_gone_names_the_leaf(plain, capsys) -> None:
    """A directory entry emptied (its segment's checksum and the record file's re-forged):
    the array has no chunk records at all."""
    a = leaf_number(plain, "w")
    (idx,) = (plain / "index").glob("*.idx")
    buf = bytearray(idx.read_bytes())
    entry = rec.decode_entries(bytes(buf[rec.directory_offset(a) : rec.directory_offset(a + 1)]))
    entry = entry.copy()
    entry[0]["count"] = 0
    entry[0]["crc"] = rec.segment_crc(b"", 0, a, name_key(f"index/{idx.name}"))
    buf[rec.directory_offset(a) : rec.directory_offset(a + 1)] = entry.tobytes()
    idx.write_bytes(bytes(buf))
    forge_manifest(
        plain, lambda d: d["processes"].__setitem__("record_crc32c", f"{crc32c(bytes(buf)):08x}")
    )
    assert_refused(plain, capsys, "'w'", "0 chunk records found")


# ---- 6. bounds and strict JSON types ------------------------------------------------------


@pytest.mark.parametrize("nblocks", [0, "+1", 2**32 - 1])
def test_a_record_block_count_that_does_not_fit_its_chunk_is_refused(plain, capsys, nblocks):
    forge_record(plain, "w", "nblocks", (lambda n: n + 1) if nblocks == "+1" else nblocks)
    assert_refused(plain, capsys, "'w'", "checksum blocks")


@pytest.mark.parametrize(
    "key, value",
    [("version", 2.0), ("version", 2), ("version", True), ("process_count", True),
     ("total_bytes", -5), ("total_bytes", 1), ("created_unix", True), ("write_mode", 3)],
)  # fmt: skip
def test_manifest_fields_of_the_wrong_type_or_value_are_refused(plain, capsys, key, value):
    forge_manifest(plain, lambda d: d.__setitem__(key, value))
    assert_refused(plain, capsys, str(plain))


def test_a_referenced_checkpoint_name_with_a_newline_is_refused(incremental, capsys) -> None:
    def newline(doc: dict[str, Any]) -> None:
        next(r for r in doc["refs"] if r)["checkpoint"] = "base\n"

    forge_manifest(incremental, newline)
    assert_refused(incremental, capsys, "malformed referenced checkpoint")


def test_a_2_0_manifest_is_still_read() -> None:
    golden = Path(__file__).parent / "golden" / "v2_0" / "single"
    assert json.loads((golden / "manifest.json").read_bytes())["version"] == 2
    m = read_manifest(LocalStorage(golden))
    assert (m.version, m.minor, m.bound) == (2, 0, False)
    assert all(f.key is None for f in m.files)  # no binding to check in 2.0


def test_an_incremental_save_on_a_2_0_base_writes_its_chunks_anew(tmp_path) -> None:
    """A 2.0 base's checksums are not bound to its files: a 2.1 save never refers to them."""
    from golden import values
    from test_golden_v1 import assert_same, expected, numpy_target

    shutil.copytree(Path(__file__).parent / "golden" / "v2_0" / "single", tmp_path / "old")
    full = values.single_tree(values.mesh())
    from snapshard.saving.incremental import UnprovableBaseWarning

    with pytest.warns(UnprovableBaseWarning, match="2.0"):
        snapshard.save(tmp_path / "new", full, base=tmp_path / "old")
    doc = json.loads((tmp_path / "new" / "manifest.json").read_bytes())
    assert doc["version"] == "2.1" and not any(doc["refs"])
    assert_same(snapshard.load(tmp_path / "new", numpy_target(full)), expected(full, plain=False))
