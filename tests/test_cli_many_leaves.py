"""The command line on checkpoints of many leaves: info's summary, --limit / --all /
--select on info and diff, and verify's and diff's batched reads (a damaged chunk among
hundreds of small arrays is still named exactly)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import snapshard
from snapshard.cli import main
from snapshard.cli.options import DEFAULT_LIMIT
from snapshard.cli.reader import open_reader

from conftest import chunk_of

N = 120  # more leaves than a text listing shows by default


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def many(n: int = N, plus: float = 0.0, changed: int = 0) -> dict:
    """n arrays of 16 float32 (leaf i holds i), the first `changed` of them plus `plus`."""
    layers = {
        f"{i:04d}": {"w": np.full(16, i + (plus if i < changed else 0.0), np.float32)}
        for i in range(n)
    }
    return {"layers": layers, "big": np.arange(64, dtype=np.int64).reshape(8, 8), "step": 7}


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "a"
    snapshard.save(path, many())
    return path


def table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("layers/", "big ", "step "))]


def test_info_prints_a_summary_and_the_first_leaves(ckpt, capsys):
    code, out, _ = run(capsys, "info", ckpt)
    assert code == 0
    lines = out.splitlines()
    assert f"in {N + 2} leaves" in lines[0]
    assert lines[1] == (
        f"leaves: {N + 1} array, 1 value; arrays by dtype: float32 {N} (7.5 KiB), int64 1 (512 B)"
    )
    rows = table_rows(out)
    assert len(rows) == DEFAULT_LIMIT and rows[0].split()[0] == "layers/0000/w"
    assert lines[-1] == f"... {N + 2 - DEFAULT_LIMIT} more leaves (--limit N or --all prints them)"
    code, out, _ = run(capsys, "info", ckpt, "--limit", 3)
    assert len(table_rows(out)) == 3 and f"... {N - 1} more leaves" in out
    code, out, _ = run(capsys, "info", ckpt, "--all")
    assert len(table_rows(out)) == N + 2 and "more leaves" not in out


def test_info_json_lists_every_leaf_unless_limited(ckpt, capsys):
    code, out, _ = run(capsys, "info", ckpt, "--json")
    doc = json.loads(out)
    assert code == 0 and len(doc["leaves"]) == doc["leaf_count"] == doc["selected"] == N + 2
    assert doc["summary"] == {
        "kinds": {"array": N + 1, "value": 1},
        "dtypes": {"float32": {"arrays": N, "bytes": N * 64}, "int64": {"arrays": 1, "bytes": 512}},
    }
    code, out, _ = run(capsys, "info", ckpt, "--json", "--limit", 2)
    doc = json.loads(out)
    assert [leaf["name"] for leaf in doc["leaves"]] == ["layers/0000/w", "layers/0001/w"]
    assert doc["leaf_count"] == N + 2


def test_info_select_by_glob_and_prefix(ckpt, capsys):
    code, out, _ = run(capsys, "info", ckpt, "--select", "layers/001*", "--select", "step")
    rows = table_rows(out)
    assert code == 0 and [r.split()[0] for r in rows] == [
        *(f"layers/{i:04d}/w" for i in range(10, 20)),
        "step",
    ]
    assert f"11 of {N + 2} leaves match --select" in out and "more leaves" not in out
    code, out, _ = run(capsys, "info", ckpt, "--select", "layers", "--json")
    doc = json.loads(out)
    assert doc["selected"] == len(doc["leaves"]) == N and doc["leaf_count"] == N + 2
    code, out, _ = run(capsys, "info", ckpt, "--select", "nothing/here")
    assert code == 0 and "0 of" in out and "LEAF" not in out


@pytest.mark.parametrize(
    "argv",
    [["--limit", "0"], ["--limit", "x"], ["--limit", "3", "--all"]],
)
def test_listing_options_refuse_bad_values(ckpt, capsys, argv):
    code, _, err = run(capsys, "info", ckpt, *argv)
    assert code == 2 and "--limit" in err


def test_diff_limits_each_listing_and_selects(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    snapshard.save(a, many())
    snapshard.save(b, many(plus=0.5, changed=60))
    code, out, _ = run(capsys, "diff", a, b, "--values", "--limit", 2)
    lines = out.splitlines()
    assert code == 1 and lines[0].startswith("≠ layers/0000/w: 16 of 16 elements differ")
    assert lines[2] == "  ... 58 more differing in value (--limit N or --all prints them)"
    assert len(lines) == 3
    code, out, _ = run(capsys, "diff", a, b, "--values")
    assert len(out.splitlines()) == DEFAULT_LIMIT + 1
    code, out, _ = run(capsys, "diff", a, b, "--values", "--all")
    assert len(out.splitlines()) == 60
    code, out, _ = run(capsys, "diff", a, b, "--values", "--json")
    doc = json.loads(out)
    assert [d["name"] for d in doc["values"]] == [f"layers/{i:04d}/w" for i in range(60)]
    assert {d["max_abs_diff"] for d in doc["values"]} == {0.5}
    code, out, _ = run(capsys, "diff", a, b, "--values", "--select", "layers/01*")
    assert code == 0 and out.startswith("identical")


def test_diff_values_mixes_batched_and_slab_reads(tmp_path, capsys):
    # --buffer-mb small enough that 'big' (8x8 int64, 1 KiB as float64 copies) is compared
    # in slabs while the small arrays go in batches; both find their differences.
    a, b = tmp_path / "a", tmp_path / "b"
    tree = many(n=40)
    snapshard.save(a, tree)
    big = tree["big"].copy()
    big[7, 7] += 3
    snapshard.save(b, {**many(n=40, plus=1.0, changed=40), "big": big})
    code, out, _ = run(capsys, "diff", a, b, "--values", "--json", "--buffer-mb", 0.0005)
    doc = json.loads(out)
    found = {d["name"]: d for d in doc["values"]}
    assert code == 1 and len(found) == 41
    assert found["big"]["differing"] == 1 and found["big"]["max_abs_diff"] == 3.0


@pytest.mark.parametrize("buffer_mb", ["64", "0.002"])
def test_verify_names_a_damaged_chunk_among_many_small_arrays(ckpt, capsys, buffer_mb):
    code, out, _ = run(capsys, "verify", ckpt, "--json", "--buffer-mb", buffer_mb)
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["bytes_checked"] == N * 64 + 512
    name, offset, _ = chunk_of(ckpt, ("layers", "0077", "w"))
    path = ckpt / name
    data = bytearray(path.read_bytes())
    data[offset + 3] ^= 0x10
    path.write_bytes(data)
    code, out, _ = run(capsys, "verify", ckpt, "--json", "--buffer-mb", buffer_mb)
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    p = doc["problem"]
    assert p["leaf"] == "layers/0077/w" and p["chunk"] == 0 and p["file"].endswith(name)
    assert doc["bytes_checked"] < N * 64  # it stopped at the damage


def test_read_boxes_gives_what_read_box_gives(ckpt):
    with open_reader(ckpt) as reader:
        leaves = {leaf.name: leaf for leaf in reader.manifest.arrays}
        big, w = leaves["big"], leaves["layers/0005/w"]
        asks = [(big, (2, 1), (5, 4)), (w, (0,), (16,)), (big, (3, 3), (3, 8)), (w, (4,), (6,))]
        got = reader.read_boxes(asks)
        for (leaf, start, stop), x in zip(asks, got, strict=True):
            assert np.array_equal(x, reader.read_box(leaf, start, stop))
            assert x.dtype == np.dtype(leaf.dtype)
    assert got[2].shape == (0, 5) and np.array_equal(got[0], np.arange(64).reshape(8, 8)[2:5, 1:4])
    assert np.array_equal(got[3], np.full(2, 5, np.float32))
    assert reader.read_boxes([]) == []
