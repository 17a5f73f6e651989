"""jax.Arrays on sub-meshes (the devices of some processes only) in a 2-process job.

In multi-controller JAX every process holds every jax.Array, with no local shards where the
sharding has none of its devices: the tree is the same on every process. One launch
(tests/workers/jax_submesh.py) saves such a tree with `save` and `save_async` and restores
it onto the same sub-meshes, onto other ones and with read-once; this process then loads
the checkpoints into NumPy. Every value is compared bit-exactly with the worker's
`reference()`.
"""

from __future__ import annotations

import numpy as np
import pytest

import multiproc

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LOADS = [
    "same_sync", "same_async", "other_sync", "other_async", "read_once", "only_a",
    "only_b_on_p1", "p0only_on_p1", "p0only_on_mix",
]  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    base = tmp_path_factory.mktemp("submesh")
    procs = multiproc.run("jax_submesh.py", 2, 4, base, timeout=240)
    return base, [p.result() for p in procs]


def test_every_leaf_restores_bit_exactly_on_the_same_and_other_sub_meshes(job):
    _, (r0, r1) = job
    loads = LOADS + (["read_once_in_mesh"] if "read_once_in_mesh" in r0 else [])
    for load in loads:
        leaves0, leaves1 = r0[load]["leaves"], r1[load]["leaves"]
        assert leaves0.keys() == leaves1.keys(), load
        for name in leaves0:
            if name in ("pp", "step"):
                continue
            (ok0, n0, devices), (ok1, n1, _) = leaves0[name], leaves1[name]
            assert ok0 and ok1, f"{load}: leaf {name!r} restored wrong values"
            if devices:  # a jax target: one shard per device, on the process that has it
                assert n0 + n1 == devices, (load, name, n0, n1, devices)
    for r in (r0, r1):  # per-process values come back to their own process
        assert r["same_sync"]["leaves"]["pp"] and r["same_async"]["leaves"]["pp"]
        assert r["same_sync"]["leaves"]["step"] == r["same_async"]["leaves"]["step"] == 17
        assert r["p0only_on_p1"]["leaves"]["step"] == 1


def test_a_process_without_shards_writes_and_reads_nothing_of_them(job):
    from workers.jax_submesh import reference

    _, (r0, r1) = job
    unique = sum(np.asarray(v).nbytes for v in reference().values())
    for save in ("sync", "async"):
        assert r0[f"{save}_bytes_written"] + r1[f"{save}_bytes_written"] == unique
    assert r0["p0only_bytes_written"] > 0 and r1["p0only_bytes_written"] == 0
    # A target on one process's devices: the other process reads nothing.
    assert r0["only_a"]["stats"]["bytes_read"] == 64 * 48 * 4
    assert r1["only_a"]["stats"]["bytes_read"] == 0
    assert r0["only_b_on_p1"]["stats"]["bytes_read"] == 0
    assert r1["only_b_on_p1"]["stats"]["bytes_read"] == 24 * 16 * 4


def test_read_once_reshards_targets_of_different_device_sets(job):
    _, (r0, r1) = job
    # e (1 MiB), b, c and d are each held by both processes: each reads half of them.
    half = (256 * 1024 * 4 + 24 * 16 * 4 + 32 * 20 * 2 + 16 * 8 * 4) // 2
    for r in (r0, r1):
        assert r["read_once"]["stats"]["bytes_from_peers"] == half
        if "read_once_in_mesh" in r:
            assert r["read_once_in_mesh"]["stats"]["bytes_from_peers"] > 0


def test_a_target_leaf_no_process_saved_is_named(job):
    _, results = job
    for r in results:
        assert r["missing"].startswith("TargetMismatchError"), r["missing"]
        assert "'absent'" in r["missing"]


@pytest.mark.parametrize("save", ["sync", "async", "p0only"])
def test_one_process_loads_the_checkpoint_into_numpy(job, save):
    import jax

    import snapshard
    from workers.jax_submesh import KEYS, digest, reference

    base, _ = job
    ref = reference()

    def resplit(name, values, me, count):
        return values  # every process's value, to compare

    out = snapshard.load(base / save, resplit=resplit)
    names = ["a", "a_rep", "key"] if save == "p0only" else list(ref)
    for name in names:
        x = out[name]
        if name in KEYS:
            x = jax.random.key_data(x)
        else:
            assert isinstance(x, np.ndarray | np.generic), (name, type(x))
        assert digest(x) == digest(ref[name]), name
    if save == "p0only":
        assert set(out) == {"a", "a_rep", "key", "step"} and out["step"] == 1
    else:
        assert out["pp"] == [{"pid": 0, "tag": "proc0"}, {"pid": 1, "tag": "proc1"}]
        assert out["step"] == 17
