"""Copies of one part of an array held by several processes, compared at the commit
(saving/copies.py): which elements fingerprint a copy, that the fingerprint depends on the
values alone (not strides or the device) and lets drift in the last bits pass, and which
processes are grouped to be compared. The multi-process behaviour (pipeline stages under one
name refused, copies and drifted copies saved) is in test_trees_differ.py."""

from __future__ import annotations

import numpy as np
import pytest

from snapshard.format.kinds import LeafKind
from snapshard.planning.layout import ArrayLayout
from snapshard.saving import copies
from snapshard.saving.save_array import SaveArray

torch = pytest.importorskip("torch")

from snapshard.torch.layout import ShardSpec, tensor_layout  # noqa: E402
from snapshard.torch.leaves import TorchSource  # noqa: E402


def _array(layout: ArrayLayout) -> SaveArray:
    return SaveArray(("x",), LeafKind.ARRAY, np.dtype("f4"), layout.shape, layout, None, None, {})


def test_the_samples_run_from_the_first_element_to_the_last():
    assert copies.sample_indices(5).tolist() == [0, 1, 2, 3, 4]
    at = copies.sample_indices(300 * 200)
    assert len(at) == copies.SAMPLES and at[0] == 0 and at[-1] == 300 * 200 - 1
    assert (np.diff(at) > 0).all()


def test_the_fingerprint_is_the_signs_of_the_samples():
    v = np.array([1.0, -2.0, 0.0, -0.0, np.nan, 3.0], np.float32)
    assert copies.signs(v) == 0b100001
    assert copies.signs(np.array([1 + 0j, -1 + 5j])) == 0b01
    assert copies.signs(np.array([True, False, True])) == 0b101


def test_processes_holding_the_same_parts_of_every_copied_array_are_grouped():
    """A (pp 2, dp 2) root mesh: a tensor sharded over dp and taken to be copied along pp
    (ranks 0 and 2 hold rows 0-3, ranks 1 and 3 rows 4-7), and one replicated over all."""
    ranks = np.array([[0, 1], [2, 3]])
    sharded = tensor_layout((8, 3), 4, ranks, [None, ShardSpec(0)]).layout
    replicated = tensor_layout((5,), 4, ranks, [None, None]).layout
    leaves = [_array(sharded), _array(replicated)]
    sig = copies.holder_signatures(leaves, np.arange(2), 4)
    assert sig[0] == sig[2] and sig[1] == sig[3] and sig[0] != sig[1]
    alone = copies.holder_signatures(leaves, np.array([1]), 4)
    assert len(set(alone.tolist())) == 1  # one box every process holds: one group


def test_sets_of_boxes_are_told_apart_not_summed():
    """Process 0 holds boxes 1 and 4, process 1 box 6 (1 + 4 + 2 = 6 + 1: a plain sum of
    box numbers would group them), process 2 every box."""
    rows = [(1, 0), (4, 0), (6, 1), *((b, 2) for b in range(8))]
    starts = np.array([[b] for b, _ in rows])
    layout = ArrayLayout((8,), 4, starts, starts + 1, np.zeros(len(rows)), [p for _, p in rows])
    sig = copies.holder_signatures([_array(layout)], np.array([0]), 3)
    assert len(set(sig.tolist())) == 3


def test_a_fingerprint_depends_on_the_tensor_not_its_strides_or_last_bits():
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(300, 200, generator=g), torch.randn(8, 8, generator=g)
    starts = np.zeros((1, 2), np.int64)
    parts = [big, big.t().contiguous().t(), big * (1 + 1e-6), small, small.to(torch.bfloat16)]
    parts.append(torch.randn(300, 200, generator=g))  # another tensor of that shape
    prints = TorchSource.copy_digests([TorchSource(p, starts) for p in parts])
    assert prints[0] == prints[1] == prints[2] and prints[3] == prints[4]
    assert bin(prints[0] ^ prints[5]).count("1") >= copies.FAR
