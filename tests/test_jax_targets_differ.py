"""JAX loads whose targets differ by process: a target refused on one process fails every
process at once, naming it, and the loads and saves after it stay paired; targets that
otherwise differ read without read-once instead of meeting in mismatched collectives. And
the local tier inside `jax.set_mesh`."""

from __future__ import annotations

import pytest

import multiproc

pytestmark = [pytest.mark.multiprocess]


def test_targets_that_differ_by_process_and_the_local_tier_under_set_mesh(tmp_path):
    first, second = (
        p.result() for p in multiproc.run("jax_targets_differ.py", 2, 2, tmp_path, timeout=240)
    )
    refused = "leaf 'cols' has shape (4, 8) in the checkpoint, the target asks for (4, 4)"
    assert refused in second["shape"]["error"]
    assert "process 1 failed" in first["shape"]["error"] and refused in first["shape"]["error"]
    for r in (first, second):  # a checkpoint process 1 cannot open: both fail, naming it
        assert "StorageError" in r["unopened"]["error"], r["unopened"]
        assert "access denied (injected on process 1)" in r["unopened"]["error"]
    for r in (first, second):
        for case in ("missing", "dtype"):
            assert r[case]["error"] is None, r[case]
        for case in ("shape", "missing", "dtype", "unopened"):
            assert r[case]["then"], case  # later loads and saves paired, and equal
        assert r["local_tier"] == {"tier": "local", "equal": True}
