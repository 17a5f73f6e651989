"""Property tests of the write planner over random meshes, shardings and process layouts."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshard.format.validate import coverage_problems
from snapshard.planning import ArrayLayout, plan_writes
from snapshard.planning.write_plan import plan_replica_parallel


def band_bounds(start: int, stop: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) cut into n bands whose lengths differ by at most one."""
    extent = stop - start
    return [(start + (j * extent) // n, start + ((j + 1) * extent) // n) for j in range(n)]


def layout_from_mesh(shape, mesh_shape, spec, devices_per_process, perm, itemsize=4):
    """The layout XLA would give: axis a split over mesh axes spec[a] (ceil-div boxes)."""
    coords = list(itertools.product(*[range(n) for n in mesh_shape]))
    n_dev = len(coords)
    starts, stops = [], []
    for c in coords:
        s, e = [], []
        for a, n in enumerate(shape):
            axes = spec[a]
            k, idx = 1, 0
            for m in axes:
                idx = idx * mesh_shape[m] + c[m]
                k *= mesh_shape[m]
            size = -(-n // k) if k else n
            lo, hi = min(idx * size, n), min((idx + 1) * size, n)
            s.append(lo)
            e.append(hi)
        starts.append(s)
        stops.append(e)
    replica, seen = [], {}
    for s, e in zip(starts, stops, strict=True):
        key = (tuple(s), tuple(e))
        replica.append(seen.get(key, 0))
        seen[key] = replica[-1] + 1
    process = [perm[d] // devices_per_process for d in range(n_dev)]
    return ArrayLayout(tuple(shape), itemsize, starts, stops, replica, process)


@st.composite
def layouts(draw, max_arrays=4):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    n_dev = int(np.prod(mesh_shape))
    dpp = draw(st.sampled_from([d for d in range(1, n_dev + 1) if n_dev % d == 0]))
    perm = draw(st.permutations(range(n_dev)))
    out = []
    for _ in range(draw(st.integers(1, max_arrays))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        free = list(range(len(mesh_shape)))
        spec = []
        for _a in range(ndim):
            k = draw(st.integers(0, min(2, len(free))))
            chosen = draw(st.permutations(free))[:k] if k else []
            for m in chosen:
                free.remove(m)
            spec.append(tuple(chosen))
        itemsize = draw(st.sampled_from([1, 2, 4]))
        out.append(layout_from_mesh(shape, mesh_shape, spec, dpp, perm, itemsize))
    return out


def boxes_and_writers(starts, stops, writer):
    return sorted(
        zip(map(tuple, starts.tolist()), map(tuple, stops.tolist()), writer.tolist(), strict=True)
    )


def items(plan, i):
    a = plan.arrays[i]
    keep = a.nbytes > 0
    return a.starts[keep], a.stops[keep], a.writer[keep], a.source_row[keep]


@settings(max_examples=300, deadline=None)
@given(
    layouts(),
    st.sampled_from(["single_replica", "replica_parallel", "balanced", "auto"]),
    st.sampled_from([0, 16, 1 << 20]),
)
def test_written_boxes_tile_every_array_once(lays, mode, min_band):
    plan = plan_writes(lays, mode, min_band_bytes=min_band)
    for i, la in enumerate(lays):
        starts, stops, writer, rows = items(plan, i)
        missing, overlapping = coverage_problems(la.shape, starts, stops)
        assert not missing and not overlapping, (la.shape, missing, overlapping)
        # The writer holds the box: its source row is on the writer and contains the box.
        assert np.array_equal(la.process_ids[rows], writer)
        assert np.all(la.starts[rows] <= starts) and np.all(la.stops[rows] >= stops)


@settings(max_examples=150, deadline=None)
@given(
    layouts(),
    st.sampled_from(["single_replica", "replica_parallel", "balanced", "auto"]),
    st.randoms(),
)
def test_plan_is_the_same_whatever_order_the_devices_come_in(lays, mode, rnd):
    plan = plan_writes(lays, mode, min_band_bytes=0)
    shuffled = []
    for la in lays:
        p = list(range(len(la.replica_ids)))
        rnd.shuffle(p)
        shuffled.append(
            ArrayLayout(
                la.shape,
                la.itemsize,
                la.starts[p],
                la.stops[p],
                la.replica_ids[p],
                la.process_ids[p],
            )
        )
    plan2 = plan_writes(shuffled, mode, min_band_bytes=0)
    assert plan.mode == plan2.mode
    for i in range(len(lays)):
        a = items(plan, i)
        b = items(plan2, i)
        assert boxes_and_writers(*a[:3]) == boxes_and_writers(*b[:3])


@settings(max_examples=200, deadline=None)
@given(layouts(max_arrays=2), st.sampled_from([0, 64]))
def test_replica_parallel_bands(lays, min_band):
    for la in lays:
        plan = plan_replica_parallel(la, min_band)
        sg = la.shards
        for u in range(sg.count):
            s, e = sg.starts[u], sg.stops[u]
            inside = (
                np.all(plan.starts >= s, axis=1)
                & np.all(plan.stops <= e, axis=1)
                & (plan.nbytes > 0)
            )
            holders = len(set(sg.cand_process[sg.cand_ptr[u] : sg.cand_ptr[u + 1]].tolist()))
            n_items = int(inside.sum())
            if sg.nbytes[u] == 0:
                continue
            if holders == 1 or sg.nbytes[u] < min_band or la.ndim == 0:
                assert n_items == 1
                continue
            ext = e - s
            fits = np.flatnonzero(ext >= holders)
            axis = int(fits[0]) if len(fits) else int(np.argmax(ext))
            expected = band_bounds(int(s[axis]), int(e[axis]), min(holders, int(ext[axis])))
            got = sorted(
                zip(
                    plan.starts[inside, axis].tolist(),
                    plan.stops[inside, axis].tolist(),
                    strict=True,
                )
            )
            assert got == [b for b in expected if b[1] > b[0]]
            lengths = [b - a for a, b in expected]
            assert max(lengths) - min(lengths) <= 1
            # Each band goes to a different process.
            assert len(set(plan.writer[inside].tolist())) == n_items


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_balanced_writes_whole_shards_and_auto_is_no_worse(lays):
    bal = plan_writes(lays, "balanced")
    rp = plan_writes(lays, "replica_parallel", min_band_bytes=0)
    auto = plan_writes(lays, "auto", min_band_bytes=0)
    for i, la in enumerate(lays):
        sg = la.shards
        got = sorted(
            map(tuple, np.concatenate([bal.arrays[i].starts, bal.arrays[i].stops], 1).tolist())
        )
        want = sorted(map(tuple, np.concatenate([sg.starts, sg.stops], 1).tolist()))
        assert got == want
    bal_max, rp_max = bal.bytes_per_process().max(), rp.bytes_per_process().max()
    if auto.mode == "replica_parallel":
        assert rp_max < bal_max
    else:
        assert auto.mode == "balanced"
        assert bal.imbalance() <= 1.05 or bal_max <= rp_max


def test_balanced_spreads_replicated_arrays_over_processes():
    # 4 processes x 2 devices, mesh (data=2, model=4): weights split over model, replicated
    # over data; small fully replicated biases. Single-replica piles on processes 0 and 1.
    weights = [layout_from_mesh((64, 64), (2, 4), [(), (1,)], 2, list(range(8))) for _ in range(6)]
    biases = [layout_from_mesh((64,), (2, 4), [()], 2, list(range(8))) for _ in range(6)]
    lays = weights + biases
    single = plan_writes(lays, "single_replica")
    bal = plan_writes(lays, "balanced")
    assert single.bytes_per_process()[2:].sum() == 0
    assert bal.imbalance() <= 1.05
    assert plan_writes(lays).mode == "balanced"


def test_uneven_bands_differ_by_one_row():
    # One 10-row shard held by 3 processes: bands of 3, 3 and 4 rows.
    la = ArrayLayout((10, 4), 4, [[0, 0]] * 3, [[10, 4]] * 3, [0, 1, 2], [0, 1, 2])
    p = plan_replica_parallel(la, 0)
    assert sorted((p.stops - p.starts)[:, 0].tolist()) == [3, 3, 4]
    assert sorted(p.writer.tolist()) == [0, 1, 2]


def test_tiny_shards_stay_whole():
    la = ArrayLayout((10, 4), 4, [[0, 0]] * 3, [[10, 4]] * 3, [0, 1, 2], [0, 1, 2])
    p = plan_replica_parallel(la, 1 << 20)
    assert len(p.nbytes) == 1 and p.writer[0] == 0


def test_the_planner_and_the_format_import_without_jax():
    import subprocess
    import sys

    code = "import sys, snapshard.planning, snapshard.format; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
