"""Read-once for dcp.load through snapshard.torch.StorageReader, across 4 real ranks (gloo
on CPU); and its pure planner."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import multiproc
from snapshard.planning.read_once import plan_dcp

ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}


def _run(root: str, *extra: str) -> list[dict]:
    procs = multiproc.run("dcp_read_once.py", 4, 1, root, *extra, timeout=150, env=ENV)
    return sorted((p.result() for p in procs), key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def saved_and_loaded(tmp_path_factory):
    """One job: the checkpoint saved, then loaded each way (its directory, the ranks'
    results)."""
    root = tmp_path_factory.mktemp("dcp_read_once")
    return root, _run(str(root))


@pytest.mark.multiprocess
def test_boxes_several_ranks_load_are_read_once_and_broadcast(saved_and_loaded):
    _, ranks = saved_and_loaded
    unique = ranks[0]["unique"]
    for r in ranks:
        for mode in ("True", "False", "None"):
            assert all(r[mode]["equal"].values()), (r["rank"], mode, r[mode]["equal"])
    once = sum(r["True"]["bytes_read"] for r in ranks)
    each = sum(r["False"]["bytes_read"] for r in ranks)
    assert once <= 1.05 * unique < each
    assert sum(r["True"]["bytes_from_peers"] for r in ranks) == each - once
    assert sum(r["False"]["bytes_from_peers"] for r in ranks) == 0
    assert sum(r["None"]["bytes_read"] for r in ranks) == each  # a local disk: off


@pytest.mark.multiprocess
def test_on_an_object_store_read_once_is_the_default(remote_prefix):
    ranks = _run(remote_prefix)
    unique = ranks[0]["unique"]
    for r in ranks:
        assert all(r["None"]["equal"].values()), (r["rank"], r["None"]["equal"])
    assert sum(r["None"]["bytes_read"] for r in ranks) <= 1.05 * unique
    assert sum(r["None"]["bytes_from_peers"] for r in ranks) > 0


@pytest.mark.multiprocess
def test_by_default_tensors_under_the_size_floor_are_read_by_every_holder(remote_prefix):
    """On an object store the default reads once only tensors of READ_ONCE_MIN_BYTES and
    more: these small ones are read by each of their holders, as with read_once=False."""
    ranks = _run(remote_prefix, "--size-floor")
    for r in ranks:
        assert all(r["None"]["equal"].values()), (r["rank"], r["None"]["equal"])
    assert sum(r["None"]["bytes_from_peers"] for r in ranks) == 0
    assert sum(r["None"]["bytes_read"] for r in ranks) == sum(
        r["False"]["bytes_read"] for r in ranks
    )


@pytest.mark.multiprocess
def test_a_failed_read_fails_every_rank_naming_it(saved_and_loaded):
    root, _ = saved_and_loaded  # the checkpoint that job wrote (the failing run writes none)
    ranks = _run(str(root), "--fail-read", "2")
    for r in ranks:
        assert r["error"] and "process 2 failed" in r["error"], r


def test_plan_gives_each_shared_box_to_one_holder_balancing_bytes():
    a = ("a", (0,), (10,))
    b = ("b", (0,), (4,))
    c = ("c", (0,), (6,))
    sizes = {a: 40, b: 16, c: 24}
    once = plan_dcp([[a, b], [a, b, c], [c]], sizes.__getitem__)
    assert once is not None
    by_key = {s.key: s for s in once.shared}
    assert by_key[a].holders == (0, 1) and by_key[b].holders == (0, 1)
    assert by_key[c].holders == (1, 2)
    assert [s.key for s in once.shared] == [a, c, b]  # largest first, one order
    readers = {k: s.reader for k, s in by_key.items()}
    assert readers[a] != readers[b] or readers[a] != readers[c]
    loads = [0, 0, 0]
    for s in once.shared:
        loads[s.reader] += sizes[s.key]
    assert max(loads) <= 40


def test_plan_is_none_without_shared_boxes():
    assert plan_dcp([[("a", (0,), (2,))], [("a", (2,), (4,))]], lambda k: 8) is None
