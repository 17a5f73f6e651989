"""safetensors with two real processes: sharded loads, stacked experts, export."""

from __future__ import annotations

import pytest
from safetensors.numpy import load_file

import multiproc
from st_files import experts, export_reference, reference, write_sharded, write_single

pytestmark = pytest.mark.multiprocess


def test_two_processes_load_their_shards_read_their_experts_and_export(tmp_path):
    sharded = write_sharded(tmp_path / "hf", reference())
    (tmp_path / "moe").mkdir()
    moe = write_single(tmp_path / "moe" / "model.safetensors", experts())
    out = tmp_path / "export.safetensors"
    procs = multiproc.run("safetensors_job.py", 2, 4, sharded, moe, out, timeout=240)
    results = sorted((p.result() for p in procs), key=lambda r: r["process"])
    for r in results:
        assert r["ok"], f"process {r['process']} built wrong values"
        for mesh_name, s in r["stats"].items():
            assert s["bytes_read"] <= 1.1 * s["bytes_needed"], (mesh_name, s)
    # Experts 0-3 live on process 0's devices, 4-7 on process 1's: each reads only those.
    for r in results:
        first = 4 * r["process"]
        assert r["experts_read"] == sorted(
            f"model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight"
            for layer in range(2)
            for e in range(first, first + 4)
        )
        assert r["experts_stats"]["bytes_read"] == 2 * 4 * 32 * 16 * 4
    # The export: both processes wrote, every byte once, and the library reads it back.
    ref = export_reference()
    assert sum(r["bytes_written"] for r in results) == sum(v.nbytes for v in ref.values())
    assert all(r["bytes_written"] > 0 for r in results)
    loaded = load_file(out)
    assert sorted(loaded) == sorted(ref)
    for k, v in ref.items():
        assert loaded[k].dtype == v.dtype and loaded[k].tobytes() == v.tobytes(), k
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export.safetensors", "hf", "moe"]
