"""The bulk paths of a restore of many small arrays: record segments decoded per record
file, whole chunks planned as columns into runs, checksum keys computed for many chunks at
once. Each checked against the one-at-a-time definition it replaces, and against damage."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import snapshard
from snapshard.errors import ChecksumMismatchError, CorruptCheckpointError
from snapshard.format import record_reads
from snapshard.format.binding import chunk_key, chunk_keys
from snapshard.format.record_reads import span_heads
from snapshard.reading.plan import JOB_BYTES, run_starts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**62)), max_size=50))
def test_chunk_keys_are_chunk_key(pairs: list[tuple[int, int]]) -> None:
    fk = np.asarray([a for a, _ in pairs], np.int64)
    off = np.asarray([b for _, b in pairs], np.int64)
    assert chunk_keys(fk, off).tolist() == [chunk_key(a, b) for a, b in pairs]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, JOB_BYTES // 3), st.booleans()),
        min_size=1,
        max_size=40,
    )
)
def test_runs_are_contiguous_and_bounded(chunks: list[tuple[int, int, bool]]) -> None:
    """Chunks (file, size, gap before) laid out in file order: each run lies in one file,
    its chunks back to back with their checksums, and passes JOB_BYTES by one chunk at most."""
    file, offset, nbytes, pos = [], [], [], {0: 0, 1: 0, 2: 0}
    for f, n, gap in sorted(chunks, key=lambda c: c[0]):
        pos[f] += 8 if gap else 0
        file.append(f)
        offset.append(pos[f])
        nbytes.append(n)
        pos[f] += n + 4
    file_a, off_a, n_a = (np.asarray(x, np.int64) for x in (file, offset, nbytes))
    heads = run_starts(file_a, off_a, n_a).tolist()
    assert heads[0] == 0 and heads == sorted(set(heads))
    for a, b in zip(heads, [*heads[1:], len(file)], strict=True):
        assert len(set(file[a:b])) == 1
        for i in range(a + 1, b):
            assert offset[i] == offset[i - 1] + nbytes[i - 1] + 4
        assert sum(nbytes[a : b - 1]) + 4 * (b - a - 1) < JOB_BYTES
    for i in range(1, len(file)):  # every break that must be there is
        if file[i] != file[i - 1] or offset[i] != offset[i - 1] + nbytes[i - 1] + 4:
            assert i in heads


def _many(tmp_path: object, n: int = 300) -> tuple[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    state = {f"w{i:04d}": rng.standard_normal((8, 4), np.float32) for i in range(n)}
    path = os.path.join(str(tmp_path), "ckpt")
    snapshard.save(path, state, snapshard.SaveOptions(writers=1))
    return path, state


def test_many_small_arrays_round_trip(tmp_path: object) -> None:
    path, state = _many(tmp_path)
    stats = snapshard.ReadStats()
    out = snapshard.load(path, stats=stats)
    assert all(np.array_equal(out[k], v) for k, v in state.items())
    assert stats.chunks_touched == len(state)
    assert stats.reads < len(state) // 10  # whole chunks back to back: few requests


def test_a_damaged_chunk_among_many_names_its_leaf(tmp_path: object) -> None:
    path, state = _many(tmp_path)
    (data,) = glob.glob(os.path.join(path, "data", "*.bin"))
    raw = bytearray(Path(data).read_bytes())
    # Chunk 150 of 300 (each 128 bytes and its 4-byte checksum, in leaf order).
    raw[150 * 132 + 7] ^= 0x40
    Path(data).write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError) as e:
        snapshard.load(path)
    assert e.value.leaf == "w0150"
    out = snapshard.load(path, options=snapshard.ReadOptions(verify=False))  # asked not to check
    assert not np.array_equal(out["w0150"], state["w0150"])


def test_records_out_of_box_order_are_sorted(tmp_path: object) -> None:
    """A record segment whose rows are not in box order (saves write them sorted; another
    writer need not) is read the same."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from snapshard.format import records as rec
    from snapshard.format.binding import name_key

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    arr = jax.device_put(x, NamedSharding(mesh, PartitionSpec("d")))
    path = os.path.join(str(tmp_path), "ckpt")
    snapshard.save(path, {"a": arr, "b": arr + 1})
    (idx,) = glob.glob(os.path.join(path, "index", "*.idx"))
    raw = bytearray(Path(idx).read_bytes())
    name = os.path.relpath(idx, path).replace(os.sep, "/")
    for leaf in range(2):
        at = rec.directory_offset(leaf)
        entry = np.frombuffer(bytes(raw[at : at + rec.DIR_ENTRY_SIZE]), rec.DIR_ENTRY)[0]
        dt = rec.record_dtype(2)
        off, count = int(entry["offset"]), int(entry["count"])
        seg = np.frombuffer(bytes(raw[off : off + count * dt.itemsize]), dt)[::-1].copy()
        raw[off : off + count * dt.itemsize] = seg.tobytes()
        crc = rec.segment_crc(seg.tobytes(), 0, leaf, name_key(name))
        raw[at + 12 : at + 16] = np.uint32(crc).tobytes()
    Path(idx).write_bytes(bytes(raw))
    out = snapshard.load(path)
    assert np.array_equal(out["a"], x) and np.array_equal(out["b"], x + 1)
    raw[rec.directory_offset(1) + 12] ^= 1  # and a segment that fails its checksum still fails
    Path(idx).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="leaf 'b'"):
        snapshard.load(path)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12000), st.integers(1, 3000)), min_size=1, max_size=40))
def test_record_spans_read_little_beyond_their_ranges(gaps: list[tuple[int, int]]) -> None:
    """Ranges laid out with gaps: every span starts at a range and reads at most 1.25 times
    what its ranges need, plus at most _TOUCH_GAP bytes per range (gaps that small always
    join)."""
    lo, hi, at = [], [], 0
    for gap, n in gaps:
        at += gap
        lo.append(at)
        hi.append(at + n)
        at += n
    heads = span_heads(np.asarray(lo, np.int64), np.asarray(hi, np.int64)).tolist()
    assert heads[0] == 0 and heads == sorted(set(heads))
    touch = record_reads._TOUCH_GAP
    for a, b in zip(heads, [*heads[1:], len(lo)], strict=True):
        need = sum(hi[i] - lo[i] for i in range(a, b))
        assert hi[b - 1] - lo[a] <= 1.25 * need + touch * (b - a)
    for i in heads[1:]:  # and a span ends only where the next range would cost too much
        assert lo[i] - hi[i - 1] > touch


def test_every_fourth_segment_of_a_record_file_is_one_request() -> None:
    """A process restoring replicated arrays that another process wrote needs every P-th
    of its record segments (here 72 bytes in 360): one request, not one per segment
    (which on an object store is a round trip each, one after the other)."""
    lo = np.arange(2500, dtype=np.int64) * 360
    assert span_heads(lo, lo + 72).tolist() == [0]


@pytest.mark.parametrize("shared_host_memory", [True, False])
def test_arrays_alike_are_assembled_from_their_own_boxes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_host_memory: bool
) -> None:
    """Arrays of one shape and sharding share how they are put together (worked out once),
    never their bytes: each gets its own boxes, on devices that share a replicated box's
    host memory or (as on accelerators) on copies of it."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from snapshard.jax import arrays as jax_arrays
    from snapshard.jax import assemble as jax_transfer

    monkeypatch.setattr(jax_arrays, "_cpu_donation_safe", shared_host_memory)
    monkeypatch.setattr(jax_transfer, "_assemblies", {})
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    specs = [PartitionSpec("a"), PartitionSpec(), PartitionSpec(None, "b"), PartitionSpec("a", "b")]
    values = {f"x{i}": np.arange(64.0).reshape(8, 8) * (i + 1) for i in range(12)}
    shardings = {k: NamedSharding(mesh, specs[i % 4]) for i, k in enumerate(values)}
    tree = {k: jax.device_put(v, shardings[k]) for k, v in values.items()}
    snapshard.save(tmp_path / "c", tree)
    target = {k: jax.ShapeDtypeStruct((8, 8), np.float64, sharding=s) for k, s in shardings.items()}
    out = snapshard.load(tmp_path / "c", target)
    for k, v in values.items():
        assert out[k].sharding == shardings[k]
        for shard in out[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index])
