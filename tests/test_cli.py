"""The `snapshard` command, run in-process through snapshard.cli.main (and once as a process)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import snapshard
from snapshard.cli import main

from conftest import chunk_of as chunk_in
from conftest import mesh, sharded

SRC = Path(__file__).parent.parent / "src"


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys, *argv) -> tuple[int, dict]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def tree(seed=0, **changes):
    rng = np.random.default_rng(seed)
    m = mesh(2, 4)
    t = {
        "w": sharded(rng.standard_normal((64, 48), dtype=np.float32), m, "data", "model"),
        "emb": sharded(
            rng.standard_normal((16, 8), dtype=np.float32).astype(jax.numpy.bfloat16),
            m,
            None,
            "model",
        ),
        "odd": np.arange(7 * 5, dtype=np.int16).reshape(7, 5),
        "key": jax.random.key(3),
        "step": 10,
    }
    t.update(changes)
    return t


def digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def saved(tmp_path):
    ckpt = tmp_path / "ckpt"
    snapshard.save(ckpt, tree())
    return ckpt


def chunk_of(ckpt: Path, leaf: str, chunk: int) -> tuple[str, int, int]:
    """(data file, offset, nbytes) of a chunk, from the chunk records."""
    return chunk_in(ckpt, (leaf,), chunk)


# ---- ls ---------------------------------------------------------------------------------


def test_ls_lists_steps_in_numeric_order_with_state(tmp_path, capsys):
    root = tmp_path / "run"
    for step in (2, 10, 1):
        snapshard.save(root / str(step), {"x": np.full(4, step, np.float32), "step": step})
    (root / "11.snapshard-tmp").mkdir()  # a save that never committed
    code, doc = run_json(capsys, "ls", root)
    assert code == 0
    names = [e["name"] for e in doc["checkpoints"]]
    assert names == ["1", "2", "10", "11"]
    states = {e["name"]: e["state"] for e in doc["checkpoints"]}
    assert states == {"1": "complete", "2": "complete", "10": "complete", "11": "incomplete"}
    first = doc["checkpoints"][0]
    assert first["step"] == 1 and first["bytes"] == 16 and first["format"] == "snapshard"
    assert first["time"].endswith("+00:00") and first["time_unix"] > 0
    code, out, _ = run(capsys, "ls", root)
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["NAME", "STATE", "FORMAT"] and len(lines) == 5
    assert lines[4].split()[:2] == ["11", "incomplete"]


def test_ls_of_a_checkpoint_is_an_error(saved, capsys):
    code, _, err = run(capsys, "ls", saved)
    assert code == 2 and "is a checkpoint" in err


def test_ls_and_info_of_an_orbax_manager_directory(tmp_path, capsys):
    pytest.importorskip("orbax.checkpoint")
    from orbax_writer import save_manager

    root = save_manager(
        tmp_path / "orbax", {s: {"w": np.full((4, 6), s, np.float32)} for s in (5, 40)}
    )
    code, doc = run_json(capsys, "ls", root)
    assert code == 0
    assert [(e["name"], e["format"], e["state"]) for e in doc["checkpoints"]] == [
        ("5", "orbax", "complete"),
        ("40", "orbax", "complete"),
    ]
    assert all(e["bytes"] > 0 and e["time_unix"] > 0 for e in doc["checkpoints"])
    code, doc = run_json(capsys, "info", root / "40")
    assert code == 0 and doc["format"] == "orbax"
    assert doc["leaves"][0]["name"] == "w" and doc["leaves"][0]["dtype"] == "float32"
    code, _, err = run(capsys, "info", root)
    assert code == 2 and "pass one of its steps (5, 40)" in err


# ---- info -------------------------------------------------------------------------------


def test_info(saved, capsys):
    code, doc = run_json(capsys, "info", saved)
    assert code == 0 and doc["format"] == "snapshard" and doc["version"] == "2.1"
    leaves = {leaf["name"]: leaf for leaf in doc["leaves"]}
    w = leaves["w"]
    assert w["shape"] == [64, 48] and w["dtype"] == "float32" and w["bytes"] == 64 * 48 * 4
    assert w["chunks"] == 8 and w["sharding"]["mesh"] == {"data": 2, "model": 4}
    assert leaves["emb"]["dtype"] == "bfloat16" and leaves["emb"]["chunks"] == 4
    assert leaves["odd"]["sharding"] == {"type": "host"}
    assert leaves["key"]["dtype"] == "key<threefry2x32>" and leaves["key"]["shape"] == []
    assert leaves["step"] == {"name": "step", "path": ["step"], "kind": "value", "value": 10}
    code, out, _ = run(capsys, "info", saved)
    assert code == 0 and "NamedSharding(data=2,model=4; data, model)" in out
    assert any(line.split()[:4] == ["w", "array", "(64,", "48)"] for line in out.splitlines())


# ---- verify -----------------------------------------------------------------------------


def test_verify_passes_on_an_intact_checkpoint(saved, capsys):
    code, doc = run_json(capsys, "verify", saved, "--buffer-mb", "0.001")
    assert code == 0 and doc["ok"] and doc["problem"] is None
    assert doc["bytes_checked"] == doc["bytes"] == 64 * 48 * 4 + 16 * 8 * 2 + 35 * 2 + 8
    code, out, _ = run(capsys, "verify", saved)
    assert code == 0 and out.startswith("OK ") and "every checksum matches" in out


def test_verify_finds_a_flipped_byte_and_names_file_leaf_and_chunk(saved, capsys):
    before = digest(saved)
    name, offset, _ = chunk_of(saved, "w", 5)
    path = saved / name
    data = bytearray(path.read_bytes())
    data[offset + 100] ^= 0x01
    path.write_bytes(data)
    code, doc = run_json(capsys, "verify", saved)
    assert code == 1 and not doc["ok"]
    p = doc["problem"]
    assert p["leaf"] == "w" and p["chunk"] == 5 and p["file"].endswith(name)
    code, out, err = run(capsys, "verify", saved)
    assert code == 1 and out.startswith("DAMAGED") and "checksum mismatch" in out
    assert "'w', chunk 5" in out and name in out and err == ""
    assert digest(saved).keys() == before.keys()  # verify never writes


def test_verify_finds_a_truncated_file(saved, capsys):
    name, offset, nbytes = chunk_of(saved, "w", 2)
    path = saved / name
    os.truncate(path, offset + nbytes // 2)
    code, doc = run_json(capsys, "verify", saved)
    assert code == 1
    p = doc["problem"]
    assert p["file"] == name and p["leaf"] == "w" and p["chunk"] == 2
    assert f"has {offset + nbytes // 2} bytes" in p["message"]


def test_verify_names_a_missing_record_file_and_the_checkpoint_once(saved, capsys):
    record = next((saved / "index").glob("*.idx"))
    record.unlink()
    code, doc = run_json(capsys, "verify", saved)
    assert code == 1 and doc["problem"]["file"] == f"index/{record.name}"
    assert "is missing" in doc["problem"]["message"]
    code, out, _ = run(capsys, "verify", saved)
    assert code == 1 and out.count(str(saved)) == 1, out


def test_verify_finds_a_damaged_manifest(saved, capsys):
    (saved / "manifest.json").write_bytes(b'{"format": "snapshard", "version": 1, "files": [')
    code, doc = run_json(capsys, "verify", saved)
    assert code == 1 and "not valid JSON" in doc["problem"]["message"]


# ---- diff -------------------------------------------------------------------------------


def test_diff_reports_added_removed_and_changed_leaves(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    base = tree()
    w = np.asarray(base["w"]).copy()
    w[3, 7] += 0.5
    snapshard.save(a, base)
    changed = tree(
        w=sharded(w, mesh(2, 4), "data", "model"), odd=np.zeros((7, 6), np.int16), step=11
    )
    del changed["key"]
    changed["new"] = np.ones(2, np.float32)
    snapshard.save(b, changed)
    code, doc = run_json(capsys, "diff", a, b)
    assert code == 1 and not doc["identical"] and doc["values"] is None
    assert [d["name"] for d in doc["added"]] == ["new"]
    assert [d["name"] for d in doc["removed"]] == ["key"]
    by_name = {d["name"]: d for d in doc["changed"]}
    assert set(by_name) == {"odd", "step"}
    assert by_name["odd"]["a"]["shape"] == [7, 5] and by_name["odd"]["b"]["shape"] == [7, 6]
    # Values, streamed in slabs far smaller than an array.
    code, doc = run_json(capsys, "diff", a, b, "--values", "--buffer-mb", "0.001")
    assert code == 1
    assert doc["values"] == [
        {"name": "w", "differing": 1, "elements": 64 * 48, "max_abs_diff": pytest.approx(0.5)}
    ]
    code, out, _ = run(capsys, "diff", a, b, "--values")
    assert "≠ w: 1 of 3072 elements differ" in out and "~ odd: (7, 5) int16 -> (7, 6) int16" in out
    code, doc = run_json(capsys, "diff", a, a, "--values")
    assert code == 0 and doc["identical"]


def test_diff_against_a_safetensors_export_matches_the_names_it_gave(tmp_path, capsys):
    """A checkpoint against its own export: leaves are matched by the export's names (their
    path joined with '.'), so only what an export leaves out (values) and real changes show."""
    ck = tmp_path / "ck"
    model = {"w": np.arange(6.0, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    snapshard.save(ck, {"model": model, "step": 3})
    out = tmp_path / "model.safetensors"
    assert run(capsys, "convert", ck, "--to", "safetensors", out)[0] == 0
    code, doc = run_json(capsys, "diff", ck, out, "--values")
    assert code == 1 and doc["added"] == [] and doc["changed"] == [] and doc["values"] == []
    assert [d["name"] for d in doc["removed"]] == ["step"]
    model["w"][1, 2] = -1.0
    snapshard.save(ck, {"model": model}, overwrite=True)
    code, doc = run_json(capsys, "diff", out, ck, "--values")
    assert code == 1 and doc["added"] == doc["removed"] == []
    assert [d["name"] for d in doc["values"]] == ["model.w"]


# ---- convert ----------------------------------------------------------------------------


def test_convert_snapshard_rechunks_and_round_trips(saved, tmp_path, capsys):
    before = digest(saved)
    dst = tmp_path / "copy"
    code, doc = run_json(capsys, "convert", saved, dst, "--chunk-mb", "0.0005")
    assert code == 0 and doc["format"] == "snapshard" and doc["source_format"] == "snapshard"
    assert doc["chunks"] > 8 + 4 + 1 + 1  # large chunks were cut
    assert digest(saved) == before  # the source is untouched
    src, out = snapshard.load(saved), snapshard.load(dst)
    for k in ("w", "emb", "odd"):
        assert out[k].tobytes() == src[k].tobytes() and out[k].dtype == src[k].dtype
    assert np.array_equal(jax.random.key_data(out["key"]), jax.random.key_data(src["key"]))
    assert out["step"] == 10
    md = snapshard.metadata(dst)
    assert md["w"].sharding == snapshard.metadata(saved)["w"].sharding  # saved sharding kept
    # A converted checkpoint restores onto a mesh, and passes verify and diff.
    target = {
        "w": jax.ShapeDtypeStruct(
            (64, 48),
            np.float32,
            sharding=jax.sharding.NamedSharding(
                mesh(8, names=("x",)), jax.sharding.PartitionSpec("x")
            ),
        )
    }
    assert np.asarray(snapshard.load(dst, target)["w"]).tobytes() == src["w"].tobytes()
    assert run(capsys, "verify", dst)[0] == 0
    assert run(capsys, "diff", saved, dst, "--values")[0] == 0


def test_convert_refuses_to_overwrite_or_write_into_the_source(saved, tmp_path, capsys):
    other = tmp_path / "other"
    snapshard.save(other, {"x": np.ones(3)})
    code, _, err = run(capsys, "convert", saved, other)
    assert code == 2 and "already exists" in err
    code, _, err = run(capsys, "convert", saved, saved, "--overwrite")
    assert code == 2 and "is the source" in err
    code, _, err = run(capsys, "convert", saved, saved / "inside")
    assert code == 2 and "inside it" in err
    assert run(capsys, "convert", saved, other, "--overwrite")[0] == 0
    assert snapshard.load(other)["step"] == 10


def test_convert_orbax_to_snapshard(tmp_path, capsys):
    pytest.importorskip("orbax.checkpoint")
    from orbax_writer import save_pytree, state_tree

    src_tree = state_tree()
    src = save_pytree(tmp_path / "orbax", src_tree, "ocdbt-zarr3")
    dst = tmp_path / "converted"
    code, doc = run_json(capsys, "convert", src, dst)
    assert code == 0 and doc["source_format"] == "orbax"
    a, b = snapshard.load(src), snapshard.load(dst)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b), strict=True
    ):
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), path
    assert b["step"] == 1000 and b["name"] == "run-7"
    assert snapshard.metadata(dst)["params"]["w"].sharding["spec"] == ["data", "model"]
    code, doc = run_json(capsys, "diff", src, dst, "--values")
    assert code == 0 and doc["identical"]
    code, doc = run_json(capsys, "verify", src)
    assert code == 0 and doc["checksums"] is None


def test_convert_to_safetensors_loads_bit_exact(saved, tmp_path, capsys):
    pytest.importorskip("snapshard.safetensors")
    from safetensors.numpy import load_file

    dst = tmp_path / "model.safetensors"
    # Tiny slabs: every tensor is written (and read back below) in many pieces.
    code, doc = run_json(
        capsys, "convert", saved, dst, "--to", "safetensors", "--chunk-mb", "0.0005"
    )
    assert code == 0 and doc["skipped"] == ["step"]
    src = snapshard.load(saved)
    loaded = load_file(str(dst))
    want = sorted((a.dtype.str, a.shape, a.tobytes()) for a in (src["w"], src["odd"]))
    got = sorted(
        (a.dtype.str, a.shape, a.tobytes())
        for a in loaded.values()
        if a.dtype.str in ("<f4", "<i2")
    )
    assert got == want
    back = tmp_path / "back"
    assert run(capsys, "convert", dst, back, "--chunk-mb", "0.0005")[0] == 0
    code, doc = run_json(capsys, "diff", saved, back, "--values")
    # Python values have no place in safetensors; a PRNG key travels as its key data.
    assert [d["name"] for d in doc["removed"]] == ["step"]
    assert [(d["name"], d["b"]["dtype"]) for d in doc["changed"]] == [("key", "uint32")]
    assert not doc["added"] and not doc["values"]


def test_safetensors_written_by_convert_are_read_back_by_every_command(saved, tmp_path, capsys):
    """A selection counts what it wrote and refuses a pattern matching nothing; the files
    convert writes (one, several with an index, or any file name) are read by the CLI."""
    pytest.importorskip("snapshard.safetensors")
    one = tmp_path / "w.safetensors"
    code, doc = run_json(capsys, "convert", saved, one, "--to", "safetensors", "--select", "w")
    w = snapshard.load(saved)["w"]
    assert code == 0 and (doc["arrays"], doc["bytes"]) == (1, w.nbytes)
    code, _, err = run(capsys, "convert", saved, tmp_path / "x.safetensors", "--to",
                       "safetensors", "--select", "typo")  # fmt: skip
    assert code == 2 and "select pattern 'typo' matches no leaf" in err
    assert not (tmp_path / "x.safetensors").exists()
    several = tmp_path / "sharded"
    argv = ["--to", "safetensors", "--select", "w", "--select", "odd", "--max-file-mb", "0.001"]
    assert run(capsys, "convert", saved, several, *argv)[0] == 0
    renamed = tmp_path / "w.bin"
    renamed.write_bytes(one.read_bytes())
    for where in (several, several / "model.safetensors.index.json", renamed):
        code, doc = run_json(capsys, "info", where)
        assert code == 0 and doc["format"] == "safetensors", where
    code, doc = run_json(capsys, "diff", renamed, one, "--values")
    assert code == 0 and doc["identical"]


# ---- for every command ------------------------------------------------------------------


def test_every_command_prints_parseable_json(saved, tmp_path, capsys):
    for argv in (
        ["ls", saved.parent],
        ["info", saved],
        ["verify", saved],
        ["diff", saved, saved],
        ["convert", saved, tmp_path / "c"],
    ):
        code, out, _ = run(capsys, *argv, "--json")
        assert code == 0, argv
        assert isinstance(json.loads(out), dict), argv


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "{missing}"],
        ["info", "{missing}"],
        ["verify", "{missing}"],
        ["diff", "{saved}", "{missing}"],
        ["convert", "{missing}", "{empty}/out"],
        ["info", "{empty}"],  # a directory that is no checkpoint
        ["info", "ftp://host/ckpt"],  # a scheme no backend serves
    ],
)
def test_bad_paths_give_one_error_line_and_exit_code_2(saved, tmp_path, capsys, argv):
    (tmp_path / "empty").mkdir()
    values = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "saved": saved}
    argv = [a.format(**values) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("snapshard: error: "), err
    code, out, err = run(capsys, *argv, "--json")
    assert code == 2 and json.loads(out)["error"] in err


def test_usage_errors_exit_2(saved, capsys):
    code, _, err = run(capsys, "verify", saved, "--buffer-mb", "lots")
    assert code == 2 and "not a number of MiB" in err and "Traceback" not in err
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys)[0] == 2


def test_progress_bar_only_on_a_terminal(saved, capsys, monkeypatch):
    pytest.importorskip("tqdm")
    assert run(capsys, "verify", saved)[2] == ""  # not a terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = run(capsys, "verify", saved)
    assert code == 0 and "verify:" in err
    assert run(capsys, "verify", saved, "--quiet")[2] == ""


def test_console_entry_point(saved):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "snapshard"]
    ok = subprocess.run(
        [*cmd, "info", str(saved), "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["format"] == "snapshard"
    bad = subprocess.run(
        [*cmd, "verify", str(saved / "nope")], env=env, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("snapshard: error: no checkpoint")


# ---- issue nits: runs, metrics, --overwrite, verify on a run, width-0 terminals ----------


def _managed_run(root: Path, steps=(1, 2)) -> Path:
    with snapshard.CheckpointManager(root, save_interval_steps=1) as mgr:
        for s in steps:
            mgr.save(s, {"x": np.full(3, s, np.float32)}, metrics={"loss": 1.0 / s, "acc": s})
    return root


def test_ls_of_a_directory_of_runs(tmp_path, capsys):
    runs = tmp_path / "runs"
    _managed_run(runs / "a", (1, 2, 10))
    _managed_run(runs / "b", (5,))
    (runs / "notes").mkdir()
    (runs / "notes" / "readme.txt").write_text("not a checkpoint")
    (runs / "7.snapshard-tmp").mkdir()
    code, doc = run_json(capsys, "ls", runs)
    assert code == 0
    by_name = {e["name"]: e for e in doc["checkpoints"]}
    assert by_name["a"]["state"] == "run" and by_name["a"]["checkpoints"] == 3
    assert by_name["a"]["latest"] == "10"
    assert by_name["b"]["state"] == "run" and by_name["b"]["latest"] == "5"
    assert by_name["notes"]["state"] == "other" and by_name["notes"]["format"] is None
    assert by_name["7"]["state"] == "incomplete"
    code, out, _ = run(capsys, "ls", runs)
    assert code == 0 and "run (3 checkpoints, latest 10)" in out and "other" in out


def test_ls_calls_a_checkpoint_without_manifest_incomplete(tmp_path, capsys):
    root = tmp_path / "run"
    snapshard.save(root / "1", {"x": np.ones(2)})
    (root / "2" / "data").mkdir(parents=True)  # an in-place save that never committed
    _, doc = run_json(capsys, "ls", root)
    assert {e["name"]: e["state"] for e in doc["checkpoints"]} == {
        "1": "complete",
        "2": "incomplete",
    }


def test_metrics_in_ls_and_info(tmp_path, capsys):
    root = _managed_run(tmp_path / "run")
    code, doc = run_json(capsys, "ls", root)
    assert code == 0
    assert [e["metrics"] for e in doc["checkpoints"]] == [
        {"loss": 1.0, "acc": 1},
        {"loss": 0.5, "acc": 2},
    ]
    code, out, _ = run(capsys, "ls", root)
    assert "METRICS" in out and "loss=0.5 acc=2" in out
    code, doc = run_json(capsys, "info", root / "2")
    assert doc["metrics"] == {"loss": 0.5, "acc": 2} and doc["step"] == 2
    code, out, _ = run(capsys, "info", root / "2")
    assert "step 2" in out and "metrics loss=0.5 acc=2" in out
    # a checkpoint saved without a manager has no metrics column
    snapshard.save(tmp_path / "plain" / "1", {"x": np.ones(2)})
    code, out, _ = run(capsys, "ls", tmp_path / "plain")
    assert "METRICS" not in out


@pytest.mark.parametrize("to", ["snapshard", "safetensors"])
def test_convert_error_names_the_flag(saved, tmp_path, capsys, to):
    dst = tmp_path / ("out.safetensors" if to == "safetensors" else "out")
    assert run(capsys, "convert", saved, dst, "--to", to)[0] == 0
    code, _, err = run(capsys, "convert", saved, dst, "--to", to)
    assert code == 2 and "--overwrite" in err and "overwrite=True" not in err


@pytest.mark.parametrize("command", ["verify", "info"])
def test_verify_or_info_of_a_run_points_to_its_steps(tmp_path, capsys, command):
    root = _managed_run(tmp_path / "run", (3, 12))
    code, _, err = run(capsys, command, root)
    assert code == 2
    assert "directory of 2 checkpoint(s)" in err
    assert f"snapshard {command} {root}/12" in err


def test_progress_bar_when_the_terminal_reports_width_zero(saved, tmp_path, capsys, monkeypatch):
    pytest.importorskip("tqdm")
    import sys

    from snapshard.cli import output

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(output.os, "get_terminal_size", lambda *a: os.terminal_size((0, 0)))
    monkeypatch.setenv("COLUMNS", "0")
    assert output._bar_width() == 80
    code = main(["convert", str(saved), str(tmp_path / "copy")])
    assert code == 0
    err = capsys.readouterr().err
    assert "convert" in err and "%|" in err  # a bar, not only the counts
    monkeypatch.setattr(output.os, "get_terminal_size", lambda *a: os.terminal_size((120, 40)))
    assert output._bar_width() is None


def test_ls_asks_tensorstore_only_where_orbax_files_are(monkeypatch, capsys):
    """An unfinished save on an object store is listed as such without asking TensorStore
    whether it is an Orbax step (without credentials it waits minutes, and logs each try)."""
    import uuid

    from snapshard.orbax import reader
    from snapshard.storage import storage_for

    def asked(location):
        raise AssertionError(f"TensorStore asked about {location}")

    monkeypatch.setattr(reader, "step_info", asked)
    root = f"memory://ls-{uuid.uuid4().hex[:8]}/run"
    snapshard.save(f"{root}/1", {"w": np.ones(4, np.float32)})
    with storage_for(f"{root}/2") as unfinished:
        unfinished.client.put("data/p00000-0badcafe-0.bin", b"0" * 8)
    code, doc = run_json(capsys, "ls", root)
    assert code == 0
    assert [(e["name"], e["state"]) for e in doc["checkpoints"]] == [
        ("1", "complete"),
        ("2", "incomplete"),
    ]
    code, _, err = run(capsys, "info", root)  # a directory of steps, not an unfinished save
    assert code == 2 and "only below others" in err and "incomplete save" not in err, err
