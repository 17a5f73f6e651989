"""bench/bench_mlperf_shape.py on 2 processes at a tiny scale: the raw method's job and
snapshard.torch's, the latter with a raw save and restore beside each of its own
(--raw-beside), every restore bit-exact, and the table's ratio to the raw beside them
computed from those pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

pytest.importorskip("torch")


def test_bench_mlperf_smoke_pairs_raw_beside(tmp_path):
    out = tmp_path / "mlperf.jsonl"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"),
           "SNAPSHARD_BENCH_DIR": str(tmp_path / "ckpt")}  # fmt: skip
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_mlperf_shape.py"), "--procs", "2",
         "--scale", "0.00002", "--saves", "2", "--restores", "2", "--rounds", "1",
         "--methods", "raw,snapshard", "--timeout", "150", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {row["method"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"raw", "snapshard"}, r.stdout
    snap, raw = rows["snapshard"], rows["raw"]
    assert "error" not in snap and "error" not in raw, (snap.get("error"), raw.get("error"))
    assert "raw_save_s" not in raw
    for op in ("save", "restore"):
        assert len(snap[f"{op}_s"]) == len(snap[f"raw_{op}_s"]) == 2
        assert all(len(t) == 2 and min(t) > 0 for t in snap[f"raw_{op}_s"])
    assert all(snap["restore_exact"]) and snap["warmup_exact"]

    import bench_mlperf_shape as b

    ratios = b.beside(list(rows.values()), "restore", "gbps", "snapshard")
    expected = [
        max(raw_t) / max(t)  # the same bytes: throughput ratio = inverse time ratio
        for t, raw_t in zip(snap["restore_s"], snap["raw_restore_s"], strict=True)
    ]
    assert ratios == pytest.approx(expected)
    assert "| snapshard restore throughput / raw beside |" in r.stdout
