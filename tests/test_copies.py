"""Copies of one part of an array held by several processes, compared by fingerprint at the
commit (saving/copies.py): which elements a fingerprint covers, that it depends on the
values alone (not on strides), and which processes are grouped to be compared. The
multi-process behaviour (pipeline stages under one name refused, copies saved) is in
test_trees_differ.py."""

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


def test_a_small_part_is_taken_whole_and_a_large_one_sampled_from_first_to_last():
    assert copies.sampled_at((64, 256), 4) is None  # 64 KiB: whole
    at = copies.sampled_at((300, 200), 4)
    assert at is not None and len(at) == copies.SAMPLES
    assert at[0] == 0 and at[-1] == 300 * 200 - 1 and (np.diff(at) > 0).all()


def test_processes_holding_the_same_parts_of_every_copied_array_are_grouped():
    """A (pp 2, dp 2) root mesh: a tensor sharded over dp and taken to be copied along pp
    (ranks 0 and 2 hold rows 0-3, ranks 1 and 3 rows 4-7), and one replicated over all."""
    ranks = np.array([[0, 1], [2, 3]])
    sharded = tensor_layout((8, 3), 4, ranks, [None, ShardSpec(0)]).layout
    replicated = tensor_layout((5,), 4, ranks, [None, None]).layout
    assert copies.held_in_copies(sharded) and copies.held_in_copies(replicated)
    leaves = [_array(sharded), _array(replicated)]
    sig = copies.holder_signatures(leaves, np.arange(2), 4)
    assert sig[0] == sig[2] and sig[1] == sig[3] and sig[0] != sig[1]
    alone = copies.holder_signatures(leaves, np.array([1]), 4)
    assert len(set(alone.tolist())) == 1  # one box every process holds: one group


def test_a_fingerprint_depends_on_the_values_not_the_strides():
    g = torch.Generator().manual_seed(0)
    big, small = torch.randn(300, 200, generator=g), torch.randn(8, 8, generator=g)
    starts = np.zeros((1, 2), np.int64)
    parts = [big, big.t().contiguous().t(), small, small.t().contiguous().t(), big + 1]
    prints = TorchSource.copy_digests([TorchSource(p, starts) for p in parts])
    assert prints[0] == prints[1] and prints[2] == prints[3]
    assert len({prints[0], prints[2], prints[4]}) == 3
