"""bench/bench_rendezvous.py on 2 processes per wing: the protocol over the real stores ends,
and the table it prints holds a row per wing with lags no smaller than zero."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_rendezvous_smoke():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "bench_rendezvous.py"), "--procs", "2",
         "--rounds", "2", "--jobs", "1", "--stagger-ms", "20"],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    rows = re.findall(
        r"^\| (jax|torch) \| here \| ([\d.]+) \[[\d.]+\] \| ([\d.]+) ", r.stdout, re.M
    )
    assert sorted(w for w, *_ in rows) == ["jax", "torch"], r.stdout
    for _, last, leader in rows:
        # the last process returns after process 0 has published the outcome
        assert float(last) >= float(leader) >= 0
