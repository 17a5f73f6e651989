"""DTensor layouts from placements alone, checked against DTensor's own sharding code."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import (  # noqa: E402
    _compute_local_shape_and_global_offset,
)
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from snapshard.errors import UnsupportedLeafError  # noqa: E402
from snapshard.format.validate import coverage_problems  # noqa: E402
from snapshard.planning import plan_writes  # noqa: E402
from snapshard.torch.layout import expand_submesh, local_shape_and_offset, tensor_layout  # noqa: E402
from snapshard.torch.leaves import placement_specs  # noqa: E402


@st.composite
def placed(draw):
    """(shape, mesh shape, torch placements), uneven sizes and empty shards included."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 11), min_size=ndim, max_size=ndim)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["shard", "shard", "replicate", "strided"]))
        d = draw(st.integers(0, ndim - 1))
        if kind == "shard":
            placements.append(Shard(d))
        elif kind == "strided":
            placements.append(_StridedShard(d, split_factor=draw(st.integers(2, 3))))
        else:
            placements.append(Replicate())
    return shape, mesh_shape, placements


def torch_local(global_t, mesh_shape, coord, placements):
    """The local tensor DTensor gives coordinate `coord`: its own splitting, dim by dim."""
    local = global_t
    for m, p in enumerate(placements):
        if isinstance(p, Shard | _StridedShard):
            pieces, _ = p._split_tensor(local, mesh_shape[m], with_padding=False, contiguous=True)
            local = pieces[coord[m]]
    return local


@settings(max_examples=300, deadline=None)
@given(placed())
def test_local_shape_and_offset_match_dtensor(case):
    shape, mesh_shape, placements = case
    specs = placement_specs(placements)
    for coord in itertools.product(*[range(n) for n in mesh_shape]):
        want = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        got = local_shape_and_offset(shape, mesh_shape, coord, specs)
        assert got == (tuple(want[0]), tuple(want[1])), (coord, placements)


@settings(max_examples=200, deadline=None)
@given(placed(), st.randoms())
def test_rows_rebuild_each_ranks_local_tensor(case, rnd):
    shape, mesh_shape, placements = case
    if math.prod(shape) == 0:
        return  # torch's own splitting needs elements to index
    n = math.prod(mesh_shape)
    perm = list(range(n))
    rnd.shuffle(perm)
    ranks = np.array(perm).reshape(mesh_shape)
    tl = tensor_layout(shape, 4, ranks, placement_specs(placements))
    lay = tl.layout
    g = torch.arange(math.prod(shape)).reshape(shape)
    gn = g.numpy()
    for coord in itertools.product(*[range(k) for k in mesh_shape]):
        want = torch_local(g, mesh_shape, coord, placements).numpy()
        rank = int(ranks[coord])
        assert tl.local_shape(rank) == want.shape
        got = np.full(want.shape, -1)
        for row in tl.rows_of(rank):
            s, e, o = lay.starts[row], lay.stops[row], tl.local_starts[row]
            dst = tuple(slice(int(a), int(a + b - c)) for a, b, c in zip(o, e, s, strict=True))
            got[dst] = gn[tuple(slice(int(a), int(b)) for a, b in zip(s, e, strict=True))]
        assert np.array_equal(got, want), (coord, placements)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(placed(), min_size=1, max_size=3),
    st.sampled_from(["single_replica", "replica_parallel", "balanced", "auto"]),
)
def test_written_boxes_tile_every_tensor_once(cases, mode):
    # One job: every tensor on a mesh of the same world size (ranks 0..n-1 in mesh order).
    lays = []
    for shape, mesh_shape, placements in cases:
        ranks = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
        lays.append(tensor_layout(shape, 2, ranks, placement_specs(placements)).layout)
    plan = plan_writes(lays, mode, min_band_bytes=0)
    for i, la in enumerate(lays):
        a = plan.arrays[i]
        keep = a.nbytes > 0
        starts, stops, rows = a.starts[keep], a.stops[keep], a.source_row[keep]
        missing, overlapping = coverage_problems(la.shape, starts, stops)
        assert not missing and not overlapping
        assert np.array_equal(la.process_ids[rows], a.writer[keep])
        assert np.all(la.starts[rows] <= starts) and np.all(la.stops[rows] >= stops)
        # Replicas of a box: identical boxes numbered 0..R-1.
        sg = la.shards
        assert np.all(la.replica_ids < np.diff(sg.cand_ptr).max(initial=1) + 1)


def test_same_inputs_give_the_same_layout_object():
    specs = placement_specs([Shard(0), Replicate()])
    a = tensor_layout((7, 3), 4, np.arange(4).reshape(2, 2), specs)
    b = tensor_layout((7, 3), 4, np.arange(4).reshape(2, 2), specs)
    assert a is b


def test_uneven_trailing_ranks_hold_empty_boxes():
    tl = tensor_layout((3, 2), 4, np.arange(4), placement_specs([Shard(0)]))
    lay = tl.layout
    assert lay.starts[:, 0].tolist() == [0, 1, 2, 3]
    assert lay.stops[:, 0].tolist() == [1, 2, 3, 3]
    plan = plan_writes([lay], "auto")
    assert int(plan.arrays[0].nbytes.sum()) == 3 * 2 * 4


def test_replicate_dims_give_replica_ids():
    tl = tensor_layout(
        (8,), 4, np.arange(6).reshape(2, 3), placement_specs([Replicate(), Shard(0)])
    )
    lay = tl.layout
    assert lay.replica_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert lay.starts[:, 0].tolist() == [0, 3, 6, 0, 3, 6]


def test_partial_is_refused_by_name():
    with pytest.raises(UnsupportedLeafError, match="Partial"):
        placement_specs([Shard(0), Partial()], "model.w")


def test_submesh_copies():
    root = np.arange(8).reshape(2, 2, 2)  # (dp, cp, tp)
    # mesh["tp"] of rank 5: ranks [4, 5]; its copies are the other (dp, cp) pairs.
    full = expand_submesh(root, np.array([4, 5]))
    assert full.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # mesh["dp"] of rank 3: [1, 3]... of rank 1: [1, 5].
    assert expand_submesh(root, np.array([1, 5])).tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # a flattened ("dp", "cp") mesh of rank 2: [0, 2, 4, 6].
    assert expand_submesh(root, np.array([0, 2, 4, 6])).tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert expand_submesh(root, root).shape == (1, 2, 2, 2)
    with pytest.raises(ValueError):
        expand_submesh(root, np.array([0, 3]))
