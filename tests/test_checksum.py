"""BlockVerifier: bytes fed in pieces of any size are checked block by block, and the first
bad block is the one reported."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from snapshard.checksum import BlockVerifier, block_crcs


@settings(max_examples=300, deadline=None)
@given(
    first=st.integers(0, 3),
    block=st.sampled_from([1, 3, 8, 64]),
    blocks=st.integers(1, 12),
    tail=st.integers(0, 63),
    cuts=st.lists(st.integers(0, 1000), max_size=8),
    bad=st.one_of(st.none(), st.integers(0, 10_000)),
    seed=st.integers(0, 2**32 - 1),
)
def test_verifier_reports_the_first_bad_block(first, block, blocks, tail, cuts, bad, seed):
    rng = np.random.default_rng(seed)
    total = blocks * block + tail % block if block > 1 else blocks
    data = rng.integers(0, 256, first * block + total, dtype=np.uint8)
    expected = block_crcs(memoryview(data), block)
    got = data.copy()
    if bad is not None:
        at = first * block + bad % total
        got[at] ^= 1 + bad % 255
    v = BlockVerifier(expected, first, block, total)
    view = memoryview(got)[first * block :]
    edges = sorted({0, total, *(c % (total + 1) for c in cuts)})
    for a, b in itertools.pairwise(edges):
        v.update(view[a:b])
    if bad is None:
        assert v.mismatch is None
        assert v.left_in_range == 0 and v.block_no == first + -(-total // block)
    else:
        blk = (first * block + bad % total) // block
        assert v.mismatch is not None
        assert v.mismatch[0] == blk
        assert v.mismatch[1] == expected[blk]
        assert v.mismatch[2] == block_crcs(memoryview(got)[blk * block :], block)[0]
