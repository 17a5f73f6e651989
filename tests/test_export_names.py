"""Export selection, renames and transposes: the Python API and `convert --to safetensors` alike."""

import json

import jax
import numpy as np
import pytest

import snapshard
import snapshard.safetensors as sst
from snapshard.cli import main

from conftest import mesh, sharded

safetensors_numpy = pytest.importorskip("safetensors.numpy")


def state():
    rng = np.random.default_rng(0)
    m = mesh(2, 4)
    return {
        "model": {
            "blocks": [
                {
                    "qkv": {
                        "kernel": {
                            "value": sharded(
                                rng.standard_normal((16, 24), dtype=np.float32), m, "data", "model"
                            )
                        }
                    },
                    "norm": {"value": np.arange(16, dtype=np.float32)},
                }
                for _ in range(2)
            ],
            "rng": jax.random.key(4),
        },
        "opt": {"mu": np.ones((16, 24), np.float32), "count": np.int32(3)},
        "step": 7,
    }


OPTIONS = {
    "select": ["model"],
    "rename": [(r"^model\.", ""), (r"\.value$", "")],
    "transpose": ["blocks.*.qkv.kernel"],
}


def cli_options(prng_keys="data"):
    argv = []
    for p in OPTIONS["select"]:
        argv += ["--select", p]
    for a, b in OPTIONS["rename"]:
        argv += ["--rename", a, b]
    for p in OPTIONS["transpose"]:
        argv += ["--transpose", p]
    return [*argv, "--prng-keys", prng_keys]


def expected(s):
    out = {}
    for i, b in enumerate(s["model"]["blocks"]):
        out[f"blocks.{i}.qkv.kernel"] = np.asarray(b["qkv"]["kernel"]["value"]).T
        out[f"blocks.{i}.norm"] = b["norm"]["value"]
    out["rng"] = np.asarray(jax.random.key_data(s["model"]["rng"]))
    return out


def test_api_and_cli_write_the_same_tensors(tmp_path, capsys):
    s = state()
    snapshard.save(tmp_path / "ckpt", s)
    result = sst.save(tmp_path / "api.safetensors", s, **OPTIONS)
    assert result.names["blocks.0.qkv.kernel"] == "model/blocks/0/qkv/kernel/value"
    code = main(
        [
            "convert",
            str(tmp_path / "ckpt"),
            str(tmp_path / "cli.safetensors"),
            "--to",
            "safetensors",
            *cli_options(),
            "--json",
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["names"]["blocks.1.norm"] == "model/blocks/1/norm/value"
    api = safetensors_numpy.load_file(tmp_path / "api.safetensors")
    cli = safetensors_numpy.load_file(tmp_path / "cli.safetensors")
    want = expected(s)
    assert set(api) == set(cli) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(api[k], v)
        np.testing.assert_array_equal(cli[k], v)
        assert api[k].dtype == v.dtype
    assert (tmp_path / "api.safetensors").read_bytes() == (
        tmp_path / "cli.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("policy", ["skip", "refuse"])
def test_prng_keys_skipped_or_refused_alike(tmp_path, capsys, policy):
    s = state()
    snapshard.save(tmp_path / "ckpt", s)
    api_dst, cli_dst = tmp_path / "api.safetensors", tmp_path / "cli.safetensors"
    argv = ["convert", str(tmp_path / "ckpt"), str(cli_dst), "--to", "safetensors"]
    argv += cli_options(policy)
    if policy == "refuse":
        with pytest.raises(snapshard.UnsupportedLeafError, match=r"'model/rng' is a PRNG key"):
            sst.save(api_dst, s, **OPTIONS, prng_keys=policy)
        assert main(argv) == 2
        assert "'model/rng' is a PRNG key" in capsys.readouterr().err
        assert not api_dst.exists() and not cli_dst.exists()
        return
    result = sst.save(api_dst, s, **OPTIONS, prng_keys=policy)
    assert result.skipped == ["model/rng"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == ["model/rng"]
    api = safetensors_numpy.load_file(api_dst)
    assert set(api) == set(safetensors_numpy.load_file(cli_dst)) == set(expected(s)) - {"rng"}


def test_sharded_sets_with_an_index(tmp_path, capsys):
    s = state()
    snapshard.save(tmp_path / "ckpt", s)
    sst.save(tmp_path / "api", s, **OPTIONS, max_file_bytes=2000)
    code = main(
        [
            "convert",
            str(tmp_path / "ckpt"),
            str(tmp_path / "cli"),
            "--to",
            "safetensors",
            *cli_options(),
            "--max-file-mb",
            str(2000 / (1 << 20)),
        ]
    )
    assert code == 0
    want = expected(s)
    for d in ("api", "cli"):
        index = json.loads((tmp_path / d / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and set(index["weight_map"]) == set(want)
        assert files[0].startswith("model-00001-of-")
        got = sst.load(tmp_path / d)
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(got[k]), v)
    # small enough for one file: model.safetensors alone
    code = main(
        [
            "convert",
            str(tmp_path / "ckpt"),
            str(tmp_path / "one"),
            "--to",
            "safetensors",
            *cli_options(),
            "--max-file-mb",
            "10",
        ]
    )
    assert code == 0 and sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "model.safetensors"
    ]


def test_names_clash_and_bad_options(tmp_path):
    s = state()
    with pytest.raises(ValueError, match="would both be named"):
        sst.save(tmp_path / "x.safetensors", s, select="model.blocks", rename={r"\.\d+\.": "."})
    with pytest.raises(ValueError, match="prng_keys"):
        sst.save(tmp_path / "x.safetensors", s, prng_keys="maybe")
    with pytest.raises(snapshard.UnsupportedLeafError, match="select="):
        sst.save(tmp_path / "x.safetensors", s)  # 'step' is a Python value
    with pytest.raises(ValueError, match=r"select pattern 'modle' matches no leaf"):
        sst.save(tmp_path / "x.safetensors", s, select=["model", "modle"])
    assert not (tmp_path / "x.safetensors").exists()
    names = sst.export_names(select=["opt.mu", "model.blocks.*.norm*"])
    assert names.selects("opt.mu") and not names.selects("opt.count")
    assert names.selects("model.blocks.1.norm.value") and not names.selects("model.rng")
    assert not names.selects("opt.mum")
