"""Compact layout descriptions (format v2): what a reader derives from them matches the
layout they describe, and the holders of any box are found without per-device rows."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshard.format import ArrayLeaf, Manifest, ProcessTable
from snapshard.format.layouts import Holders, Mesh, mesh_layout


@st.composite
def cases(draw):
    nd_mesh = draw(st.integers(1, 3))
    sizes = tuple(draw(st.sampled_from([1, 2, 3, 4])) for _ in range(nd_mesh))
    axes = tuple(f"a{i}" for i in range(nd_mesh))
    nproc = draw(st.integers(1, math.prod(sizes)))
    procs = np.asarray(draw(st.permutations(range(math.prod(sizes))))) % nproc
    nd = draw(st.integers(1, 3))
    free = list(axes)
    spec: list[list[str]] = []
    for _ in range(nd):
        take = draw(st.integers(0, min(2, len(free))))
        spec.append([free.pop(0) for _ in range(take)])
    pieces = [math.prod(sizes[axes.index(a)] for a in s) for s in spec]
    shape = tuple(k * draw(st.integers(1, 3)) for k in pieces)
    start = [draw(st.integers(0, n - 1)) for n in shape]
    stop = [draw(st.integers(a + 1, n)) for a, n in zip(start, shape, strict=True)]
    return Mesh(axes, sizes, procs.astype(np.int64)), spec, shape, nproc, start, stop


@settings(max_examples=200, deadline=None)
@given(cases())
def test_holders_of_a_box_from_the_mesh_grid_equal_those_of_the_device_rows(case):
    mesh, spec, shape, nproc, start, stop = case
    lay = mesh_layout(mesh, spec, shape, 4, "test")
    # Holders from the per-device rows: every process with a device whose box overlaps.
    hit = np.all(lay.starts < np.asarray(stop), axis=1) & np.all(
        lay.stops > np.asarray(start), axis=1
    )
    want = np.unique(lay.process_ids[hit])
    leaf = ArrayLeaf(("x",), "array", "float32", shape, layout=0, chunk_count=1)
    m = Manifest(
        structure={"t": "leaf", "i": 0}, leaves=[leaf], files=[], process_count=nproc,
        meshes=[mesh.to_json()], layouts=[{"kind": "mesh", "mesh": 0, "spec": spec}],
        processes=ProcessTable(["0" * 8] * nproc, [[]] * nproc, [0] * nproc, [0] * nproc),
    )  # fmt: skip
    box = (np.asarray(start, np.int64), np.asarray(stop, np.int64))
    assert Holders(m, "test").candidates(leaf, [box]).tolist() == want.tolist()
