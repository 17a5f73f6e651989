"""bench/bench_metadata.py --smoke builds the real v2 metadata of a 64-process job and prints
its sizes: the manifest must stay within what its arithmetic allows (no term per chunk)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_metadata_smoke(tmp_path):
    out = tmp_path / "smoke.jsonl"
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_metadata.py"), "--smoke",
         "--latency-ms", "1", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"\| manifest\.json \(serialised\) \| ([\d,]+) B", r.stdout)
    assert m, r.stdout
    printed = int(m.group(1).replace(",", ""))
    row = json.loads(out.read_text().splitlines()[-1])
    assert printed == row["manifest_bytes"]
    p, leaves, chunks = row["processes"], row["leaves"], row["chunks"]
    assert p == 64
    # What the manifest may hold: per leaf its path, dtype, shape, the sharding described
    # for people, layout number, chunk count and at most one writer (< 512 bytes of JSON,
    # tree node included); per process a nonce, a record size and crc (8 + ~8 + 8 hex) and
    # one data file size (< 48 bytes); the mesh's process of every device, packed (8 bytes
    # per device before compression, 4/3 for base64), and a few layouts (< 16 KiB).
    bound = 512 * leaves + 48 * p + (8 * 8 * p) * 4 // 3 + (16 << 10)
    assert printed <= bound, (printed, bound)
    # v1 listed every chunk inline (at least ~112 bytes each): v2 has no term per chunk.
    assert chunks * 112 > 10 * printed
    # the commit reads no record file and the reader fetched records at all
    assert row["commit_requests"] >= 3
    for t in ("same", "P/2"):
        assert row["read"][t]["record_bytes"] >= row["targets"][t]["needed_records"]
    assert "## Targets at P = 64" in r.stdout
