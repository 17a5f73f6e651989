"""The harness that starts multi-process tests (multiproc.py): a job whose coordinator's
port was taken by another program between its choice and the bind starts again on another
port, at once, instead of failing the test (or waiting out its timeout on the other ranks)."""

from __future__ import annotations

import socket
import time

import pytest

pytest.importorskip("torch")

import multiproc

pytestmark = pytest.mark.multiprocess


def test_a_job_whose_port_is_taken_starts_again_on_another(tmp_path, monkeypatch):
    chosen, held, starts = [], [], []
    real_free, real_start = multiproc.free_port, multiproc.start

    def taken_first() -> int:
        port = real_free()
        chosen.append(port)
        if not held:  # another program binds the first port chosen before the job does
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        return port

    def counted(*args, **kwargs):
        starts.append(1)
        return real_start(*args, **kwargs)

    monkeypatch.setattr(multiproc, "free_port", taken_first)
    monkeypatch.setattr(multiproc, "start", counted)
    t0 = time.monotonic()
    try:
        done = multiproc.run(
            "dcp_corrupt.py", 2, 1, "save", tmp_path / "ck", timeout=120,
            env={"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"},
        )  # fmt: skip
    finally:
        held[0].close()
    assert len(starts) == 2 and len(set(chosen)) == 2
    assert all(p.results for p in done)
    assert time.monotonic() - t0 < 60  # the second rank did not wait out the first job
