"""Read-once restores of torch state across 4 real ranks (gloo on CPU): a box held by
several ranks is read from storage once and broadcast to its other holders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

import multiproc

ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}  # a PyTorch-only install
ALL_NFS, HALF_NFS, ALL_NFS_FLOOR = "0,1,2,3", "0,1", "0,1,2,3/floor"


@pytest.fixture(scope="module")
def read_once_job(tmp_path_factory):
    """One job of torch_read_once.py (its directory, its ranks' results): the restores
    with read-once on, off and by default, through the manager, then by default under each
    mount table of the network tests (one case each)."""
    root = tmp_path_factory.mktemp("read_once")
    return root, _run(str(root), *(f"--network={c}" for c in (ALL_NFS, HALF_NFS, ALL_NFS_FLOOR)))


@pytest.fixture(scope="module")
def bands_job(tmp_path_factory):
    """One job of torch_bands.py (its directory, its ranks' results)."""
    root = tmp_path_factory.mktemp("bands")
    procs = multiproc.run("torch_bands.py", 4, 1, str(root), timeout=150, env=ENV)
    return root, [p.result() for p in procs]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_replicated_boxes_are_read_once_and_broadcast(read_once_job):
    from snapshard.storage.mounts import is_network_filesystem

    root, ranks = read_once_job
    _check(ranks)
    if not is_network_filesystem(root):  # on a local disk the default: off
        on_default = sum(r["None"]["bytes_read"] for r in ranks)
        assert on_default == sum(r["False"]["bytes_read"] for r in ranks)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_on_an_object_store_read_once_is_the_default(remote_prefix):
    ranks = _run(remote_prefix)
    _check(ranks)
    unique = ranks[0]["unique"]
    assert sum(r["None"]["bytes_read"] for r in ranks) <= 1.05 * unique
    assert sum(r["None"]["bytes_from_peers"] for r in ranks) > 0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("network", [ALL_NFS, HALF_NFS], ids=["all-nfs", "half-nfs"])
def test_on_a_network_filesystem_read_once_is_the_default_where_every_rank_sees_one(
    read_once_job, network
):
    """The default follows the mount table; where the ranks' tables disagree (a file server
    that also computes sees its own disk), they agree on off instead of some waiting for
    the others in the read-once agreement."""
    _, ranks = read_once_job
    unique = ranks[0]["unique"]
    case = f"network:{network}"
    for r in ranks:
        assert all(r[case]["equal"].values()), (r["rank"], r[case]["equal"])
    read = sum(r[case]["bytes_read"] for r in ranks)
    peers = sum(r[case]["bytes_from_peers"] for r in ranks)
    if network == ALL_NFS:
        assert read <= 1.05 * unique and peers > 0
    else:
        assert read > 2 * unique and peers == 0  # every holder read its own boxes


@pytest.mark.multiprocess
@pytest.mark.slow
def test_by_default_tensors_under_the_size_floor_are_read_by_every_holder(read_once_job):
    """The default reads once only tensors of READ_ONCE_MIN_BYTES and more (moving a small
    one costs more than reading it again): on a network filesystem, tensors this small are
    read by each of their holders."""
    _, ranks = read_once_job
    unique = ranks[0]["unique"]
    case = f"network:{ALL_NFS_FLOOR}"
    for r in ranks:
        assert all(r[case]["equal"].values()), (r["rank"], r[case]["equal"])
    assert sum(r[case]["bytes_from_peers"] for r in ranks) == 0
    assert sum(r[case]["bytes_read"] for r in ranks) > 2 * unique


def _run(root: str, *extra: str) -> list[dict]:
    procs = multiproc.run("torch_read_once.py", 4, 1, root, *extra, timeout=150, env=ENV)
    return [p.result() for p in procs]


def _check(ranks: list[dict]) -> None:
    unique = ranks[0]["unique"]
    for mode in ("True", "False", "None", "manager"):
        for r in ranks:
            assert all(r[mode]["equal"].values()), (mode, r["rank"], r[mode]["equal"])
    on = [r["True"] for r in ranks]
    off = [r["False"] for r in ranks]
    # Checksums of the blocks read come on top of the array bytes: a few bytes per chunk.
    assert unique <= sum(x["bytes_read"] for x in on) <= 1.05 * unique
    assert sum(x["bytes_from_peers"] for x in on) > 0
    # Each rank read a share: the byte-balanced plan spreads the boxes over the holders.
    assert max(x["bytes_read"] for x in on) < 0.5 * unique
    # Without read-once every holder reads its boxes: a, b twice, c and d 4 times.
    assert sum(x["bytes_read"] for x in off) > 2 * unique
    assert all(x["bytes_from_peers"] == 0 for x in off)
    managed = [r["manager"] for r in ranks]
    assert sum(x["bytes_read"] for x in managed) <= 1.05 * unique
    assert sum(x["bytes_from_peers"] for x in managed) > 0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "job,rank,extra",
    [
        ("read_once_job", 1, []),
        ("bands_job", 2, []),
        ("bands_job", 2, ["--collective"]),
        ("bands_job", 3, ["--plain"]),
    ],
    ids=["broadcast", "bands", "bands-collective", "plain-then-bands"],
)
def test_a_failed_read_fails_every_rank_naming_it(request, job, rank, extra):
    # The restore of the checkpoint that job saved (its failing run writes nothing).
    root, _ = request.getfixturevalue(job)
    worker = {"read_once_job": "torch_read_once.py", "bands_job": "torch_bands.py"}[job]
    done = multiproc.run(
        worker, 4, 1, str(root), "--fail-read", str(rank), *extra, timeout=90, env=ENV
    )
    for p in done:
        res = p.result()
        assert res["error"] is not None, res
        assert f"process {rank} failed" in res["error"], res
        assert "injected read failure" in res["error"], res
        assert res["seconds"] < 10  # its timeout_s is 20: failing fast, not timing out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_reshard_that_cuts_saved_rows_reads_each_byte_once(bands_job):
    """Shard(0) saved, Shard(1) (and a 2-D mesh cutting two later axes) restored: bands of
    whole rows are read once and exchanged; without read-once each rank reads whole
    checksum blocks of every saved row it needs part of."""
    _, ranks = bands_job
    unique = ranks[0]["unique"]
    for mode in ("True/None", "True/100000", "collective/100000", "False/None"):
        for r in ranks:
            assert all(r[mode]["equal"].values()), (mode, r["rank"], r[mode]["equal"])
    # one batch, then several, through shared memory (these ranks share a host), then
    # through the collective
    for mode in ("True/None", "True/100000", "collective/100000"):
        on = [r[mode] for r in ranks]
        assert unique <= sum(x["bytes_read"] for x in on) <= 1.05 * unique
        # each rank reads its band, a quarter, and receives the rest of its shards
        assert max(x["bytes_read"] for x in on) <= 0.27 * unique
        assert sum(x["bytes_from_peers"] for x in on) >= 0.7 * unique
    off = [r["False/None"] for r in ranks]
    assert sum(x["bytes_read"] for x in off) >= 3 * unique
    assert all(x["bytes_from_peers"] == 0 for x in off)
    # [Replicate(), Shard(1)] on a 2 x 2 mesh: each column half on 2 ranks, read once as
    # bands (a broadcast reader would read whole rows: 2x), each holder getting its copy
    # each rank receives 3/4 of its 40 x 32 half, in one exchange or in slabs (a 4 kB
    # budget; slabs of a few rows re-read the checksum block they cut: not counted)
    r_bytes = 40 * 64 * 4
    for mode in ("replicated/None", "replicated/4096"):
        rep = [r[mode] for r in ranks]
        assert all(all(x["equal"].values()) for x in rep), (mode, rep)
        assert sum(x["bytes_from_peers"] for x in rep) == 4 * 30 * 32 * 4, mode
    once = sum(r["replicated/None"]["bytes_read"] for r in ranks)
    assert r_bytes <= once <= 1.05 * r_bytes
    # the loads' agreements (one per batch) leave no key in the process group's store
    assert [r["store_keys_added"] for r in ranks] == [0] * 4


@st.composite
def placed_layouts(draw):
    """A job's tensors on one mesh: each mesh dimension Replicate or Shard(d), so a box may
    be held by a few ranks (one replica group), by all, or by one."""
    import numpy as np

    from snapshard.torch.layout import ShardSpec, tensor_layout

    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    world = int(np.prod(mesh_shape))
    ranks = np.arange(world).reshape(mesh_shape)
    layouts = []
    for _ in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(1, 2))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        specs = [
            draw(st.sampled_from([None, *[ShardSpec(d) for d in range(ndim)]])) for _ in mesh_shape
        ]
        layouts.append(tensor_layout(shape, 4, ranks, specs).layout)
    return layouts, world


class _Fill:
    def __init__(self, start, stop):
        self.start, self.stop, self.region = start, stop, object()


@given(placed_layouts())
@settings(max_examples=80, deadline=None)
def test_every_rank_plans_the_same_readers_among_each_boxs_holders(case):
    from snapshard.planning.read_once import as_box
    from snapshard.torch.read_once import plan_layouts

    layouts, world = case
    plans = [plan_layouts(list(layouts), r, world) for r in range(world)]
    if plans[0] is None:  # no box with several holders
        assert all(p is None for p in plans)
        return
    assert all(p is not None and p.shared == plans[0].shared for p in plans)  # type: ignore[union-attr]
    shared = {(s.leaf, s.box): s for s in plans[0].shared}  # type: ignore[union-attr]
    for i, la in enumerate(layouts):
        holders: dict = {}
        for row in range(len(la.process_ids)):
            box = as_box(la.starts[row], la.stops[row])
            if la.nbytes and all(b > a for a, b in zip(*box, strict=True)):
                holders.setdefault(box, set()).add(int(la.process_ids[row]))
        for box, who in holders.items():
            readers = [r for r in range(world) if (i, box) in plans[r].reads]  # type: ignore[union-attr]
            assert len(readers) == 1 and readers[0] in who
            if len(who) > 1:
                s = shared[(i, box)]
                assert set(s.holders) == who and s.reader == readers[0]
        # Each rank keeps the fills it reads and can receive all the others.
        for r in range(world):
            rows = [k for k in range(len(la.process_ids)) if la.process_ids[k] == r]
            fills = [_Fill(la.starts[k], la.stops[k]) for k in rows]
            fills = [f for f in fills if all(b > a for a, b in zip(f.start, f.stop, strict=True))]
            kept = plans[r].bind(i, fills)  # type: ignore[union-attr]
            assert {as_box(f.start, f.stop) for f in kept} == {
                box
                for (j, box) in plans[r].reads
                if j == i  # type: ignore[union-attr]
            }


@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
    world=st.integers(2, 8),
)
@settings(max_examples=60, deadline=None)
def test_every_shared_box_has_one_reader_and_the_reads_are_balanced(sizes, world):
    import torch

    from snapshard.torch.read_once import plan

    targets = [torch.zeros(n) for n in sizes]
    plans = [plan(targets, r, world, frozenset({"cpu"})) for r in range(world)]
    if sum(sizes) == 0:
        assert all(p is None for p in plans)
        return
    assert all(p is not None and p.shared == plans[0].shared for p in plans)  # type: ignore[union-attr]
    reads = [p.reads for p in plans]  # type: ignore[union-attr]
    boxes = [(i, ((0,), (n,))) for i, n in enumerate(sizes) if n]
    # Each box is read by exactly one rank, the reader the shared plan names.
    for b in boxes:
        assert sum(b in r for r in reads) == 1
    for s in plans[0].shared:  # type: ignore[union-attr]
        assert s.holders == tuple(range(world)) and (s.leaf, s.box) in reads[s.reader]
    load = [sum(sizes[i] for i, _ in r) for r in reads]
    # Greedy, largest first: within the largest box of the mean.
    assert max(load) <= sum(sizes) / world + max(sizes)


def test_tensors_on_a_device_the_group_has_no_backend_for_are_read_by_every_rank():
    import torch

    from snapshard.torch.read_once import plan

    targets = [torch.zeros(1000), torch.zeros(10)]
    assert plan(targets, 0, 4, frozenset({"cuda"})) is None  # an NCCL-only group: CPU left out
    p = plan(targets, 0, 4, frozenset({"cpu", "cuda"}))
    assert p is not None and p.leaves == frozenset({0, 1})
