"""Per-block compression: bit-exact round trips, partial reads that decompress only the blocks
they touch, checksums of every uncompressed block, and codecs with incremental saves."""

from __future__ import annotations

import json
import threading

import jax
import ml_dtypes
import numpy as np
import pytest

import snapshard
from snapshard import ReadOptions, SaveOptions
from snapshard.errors import CorruptCheckpointError
from snapshard.format import compressed_reads, compression
from snapshard.storage import LocalStorage

pytestmark = pytest.mark.skipif(not compression.available(), reason="zstd is not installed")


def state():
    rng = np.random.default_rng(1)
    return {
        "w": (rng.standard_normal((512, 384)) * 0.02).astype(ml_dtypes.bfloat16),
        "m": (rng.standard_normal((300, 257)) * 1e-3).astype(np.float32),
        "ids": np.arange(100_000, dtype=np.int64) % 977,
        "mask": rng.random((77, 13)) > 0.5,
        "tiny": np.float16([1.5, -2.0]),
        "c": (rng.standard_normal(999) + 1j).astype(np.complex64),
        "empty": np.zeros((0, 5), np.float32),
        "lr": 1e-4,
    }


def same(a, b):
    for k, v in b.items():
        if isinstance(v, np.ndarray):
            assert a[k].dtype == v.dtype and a[k].shape == v.shape, k
            assert np.array_equal(a[k].view(np.uint8), v.view(np.uint8)), k
        else:
            assert a[k] == v, k


@pytest.mark.parametrize("option", ["zstd", "zstd+shuffle", "zstd-noshuffle"])
def test_round_trips_are_bit_exact(tmp_path, option):
    s = state()
    snapshard.save(tmp_path / "c", s, options=SaveOptions(compression=option))
    doc = json.loads((tmp_path / "c" / "manifest.json").read_bytes())
    assert doc["codecs"]
    same(snapshard.load(tmp_path / "c"), s)
    same(snapshard.load(tmp_path / "c", options=ReadOptions(verify=False)), s)


def test_compressible_state_takes_fewer_bytes(tmp_path):
    s = {"ids": np.arange(1 << 20, dtype=np.int64) % 977}
    snapshard.save(tmp_path / "p", s)
    snapshard.save(tmp_path / "c", s, options=SaveOptions(compression="zstd"))
    size = lambda d: sum(f.stat().st_size for f in (d / "data").iterdir())  # noqa: E731
    assert size(tmp_path / "c") < size(tmp_path / "p") / 4
    same(snapshard.load(tmp_path / "c"), s)


def count_data_reads(monkeypatch):
    counted = {"bytes": 0}
    real = LocalStorage.read_into

    def read_into(self, name, offset, buffers):
        if name.startswith("data/"):
            counted["bytes"] += sum(memoryview(b).nbytes for b in buffers)
        real(self, name, offset, buffers)

    monkeypatch.setattr(LocalStorage, "read_into", read_into)
    return counted


def blocks_needed(path, rows, cols, shape, itemsize):
    """Compressed bytes of the blocks that hold rows x cols of the saved (single) chunk."""
    data = next((path / "data").iterdir()).read_bytes()
    nbytes = shape[0] * shape[1] * itemsize
    block = snapshard.format.checksum_block(nbytes)
    nblocks = -(-nbytes // block)
    crc_at = len(data) - 12 * nblocks - 8
    offs = np.frombuffer(data[crc_at : crc_at + 8 * (nblocks + 1)], "<u8")
    touched = set()
    row = shape[1] * itemsize
    for r in range(*rows):
        a, b = r * row + cols[0] * itemsize, r * row + cols[1] * itemsize
        touched.update(range(a // block, -(-b // block)))
    return sum(int(offs[k + 1] - offs[k]) for k in touched), len(touched)


@pytest.mark.parametrize(
    "rows,cols", [((100, 140), (0, 512)), ((300, 301), (0, 512)), ((0, 1024), (0, 512)),
                  ((10, 900), (100, 101))]
)  # fmt: skip
def test_partial_restore_reads_only_the_blocks_it_needs(tmp_path, monkeypatch, rows, cols):
    from snapshard.cli.reader import open_reader

    x = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512) % 1013 * 0.5
    snapshard.save(tmp_path / "c", {"x": x}, options=SaveOptions(compression="zstd"))
    counted = count_data_reads(monkeypatch)
    reader = open_reader(tmp_path / "c")
    leaf = reader.manifest.arrays[0]
    box = reader.read_box(leaf, (rows[0], cols[0]), (rows[1], cols[1]))
    assert np.array_equal(box, x[rows[0] : rows[1], cols[0] : cols[1]])
    needed, nblk = blocks_needed(tmp_path / "c", rows, cols, x.shape, 4)
    # the blocks it touches, plus their offsets (8 bytes each, one more) and checksums
    assert counted["bytes"] <= 1.1 * needed
    assert counted["bytes"] <= needed + 12 * nblk + 8


def test_a_damaged_block_fails_its_checksum_or_decompression(tmp_path):
    x = (np.arange(1 << 18, dtype=np.float32) % 101).reshape(512, 512)
    snapshard.save(tmp_path / "c", {"x": x}, options=SaveOptions(compression="zstd"))
    f = next((tmp_path / "c" / "data").iterdir())
    raw = bytearray(f.read_bytes())
    raw[50] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError):
        snapshard.load(tmp_path / "c")


def test_incremental_saves_refer_to_compressed_chunks(tmp_path):
    s = state()
    snapshard.save(tmp_path / "1", s, options=SaveOptions(compression="zstd", hashes=True))
    t = snapshard.save(
        tmp_path / "2", s, options=SaveOptions(compression="zstd"), base=tmp_path / "1"
    )
    assert t.bytes_written == 0
    same(snapshard.load(tmp_path / "2"), s)
    part = snapshard.load(tmp_path / "2", {"m": jax.ShapeDtypeStruct((300, 257), np.float32)})
    assert np.array_equal(part["m"], s["m"])


@pytest.fixture
def small_groups(monkeypatch):
    """Codec thresholds shrunk so that small arrays take the large-chunk paths: groups of
    blocks in the codec threads, and reads in windows of a few blocks."""
    monkeypatch.setattr(compression, "PARALLEL_MIN", 0)
    monkeypatch.setattr(compression, "_GROUP", 8192)
    monkeypatch.setattr(compression, "_threads", lambda: 2)
    threads = set()
    for name in ("_unpack_block", "_unpack_whole"):  # where blocks are decompressed
        real = getattr(compressed_reads, name)

        def unpack(*a, real=real, **kw):
            threads.add(threading.current_thread().name)
            return real(*a, **kw)

        monkeypatch.setattr(compressed_reads, name, unpack)
    return threads


@pytest.mark.parametrize("option", ["zstd", "zstd+shuffle"])
@pytest.mark.parametrize("window", [1 << 30, 20_000])
def test_large_chunk_paths_are_bit_exact(tmp_path, monkeypatch, small_groups, option, window):
    monkeypatch.setattr(compressed_reads, "WINDOW", window)
    s = state()
    s["big"] = (np.random.default_rng(3).standard_normal((700, 1000)) * 0.02).astype(np.float32)
    snapshard.save(tmp_path / "c", s, options=SaveOptions(compression=option))
    same(snapshard.load(tmp_path / "c"), s)
    same(snapshard.load(tmp_path / "c", options=ReadOptions(verify=False)), s)
    assert any(t.startswith("snapshard-codec") for t in small_groups)
    # strided targets (column bands: many pieces per read) and partial rows
    from snapshard.cli.reader import open_reader

    reader = open_reader(tmp_path / "c")
    leaf = next(a for a in reader.manifest.arrays if a.name.endswith("big"))
    for lo, hi in (((0, 0), (700, 1000)), ((3, 17), (650, 990)), ((100, 0), (101, 1000))):
        box = reader.read_box(leaf, lo, hi)
        assert np.array_equal(box, s["big"][lo[0] : hi[0], lo[1] : hi[1]])


def test_a_whole_chunk_is_one_read(tmp_path, monkeypatch):
    x = (np.arange(1 << 20, dtype=np.float32) % 1013).reshape(1024, 1024)
    snapshard.save(tmp_path / "c", {"x": x}, options=SaveOptions(compression="zstd"))
    data = next((tmp_path / "c" / "data").iterdir())
    calls = []
    real = LocalStorage.read_into

    def read_into(self, name, offset, buffers):
        if name.startswith("data/"):
            calls.append(sum(memoryview(b).nbytes for b in buffers))
        real(self, name, offset, buffers)

    monkeypatch.setattr(LocalStorage, "read_into", read_into)
    assert np.array_equal(snapshard.load(tmp_path / "c")["x"], x)
    # the blocks, their offsets and their checksums in one read: the whole data file
    assert calls == [data.stat().st_size]


@pytest.mark.parametrize("window", [1 << 30, 20_000])
def test_damage_is_found_in_the_codec_threads(tmp_path, monkeypatch, small_groups, window):
    monkeypatch.setattr(compressed_reads, "WINDOW", window)
    x = (np.arange(1 << 19, dtype=np.float32) % 101).reshape(1024, 512)
    snapshard.save(tmp_path / "c", {"x": x}, options=SaveOptions(compression="zstd"))
    f = next((tmp_path / "c" / "data").iterdir())
    good = f.read_bytes()
    crc_at = len(good) - 12 * (-(-x.nbytes // snapshard.format.checksum_block(x.nbytes))) - 8
    for at in (10, crc_at // 2, crc_at - 3):  # first, a middle and the last block
        raw = bytearray(good)
        raw[at] ^= 0x40
        f.write_bytes(bytes(raw))
        with pytest.raises(CorruptCheckpointError):
            snapshard.load(tmp_path / "c")
    f.write_bytes(good)
    assert np.array_equal(snapshard.load(tmp_path / "c")["x"], x)


def test_a_block_of_the_wrong_size_is_refused():
    """A frame that holds more or fewer bytes than its block is corrupt, checksums or not."""
    z = compression.compress(np.arange(5000, dtype=np.uint8).data, 1)
    out = np.empty(4000, np.uint8)
    assert compression.decompress_into(memoryview(z), out.data) > 4000
    out = np.empty(6000, np.uint8)
    assert compression.decompress_into(memoryview(z), out.data) == 5000


def test_frames_without_their_size_in_the_header_read_back(tmp_path, monkeypatch):
    """Other zstd writers may leave the content size out of a frame's header."""
    import zstandard

    plain = zstandard.ZstdCompressor(level=1, write_content_size=False)
    monkeypatch.setattr(compression, "compress", lambda data, level: plain.compress(data))
    x = (np.arange(1 << 18, dtype=np.float32) % 101).reshape(512, 512)
    snapshard.save(tmp_path / "c", {"x": x}, options=SaveOptions(compression="zstd"))
    monkeypatch.undo()
    assert np.array_equal(snapshard.load(tmp_path / "c")["x"], x)
    from snapshard.cli.reader import open_reader

    reader = open_reader(tmp_path / "c")
    box = reader.read_box(reader.manifest.arrays[0], (7, 3), (300, 500))
    assert np.array_equal(box, x[7:300, 3:500])


def test_verify_names_a_block_that_does_not_decompress_once(tmp_path, capsys):
    """verify --json names the damaged chunk's file as a checksum mismatch names it (the
    whole path), and its message names the chunk once."""
    from snapshard.cli import main

    snapshard.save(
        tmp_path / "c", {"sparse": np.zeros(1 << 16, np.float32)},
        options=SaveOptions(compression="zstd"),
    )  # fmt: skip
    (data,) = (tmp_path / "c" / "data").iterdir()
    raw = bytearray(data.read_bytes())
    raw[20] ^= 0xFF  # inside the first compressed block
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "c"), "--json"]) == 1
    problem = json.loads(capsys.readouterr().out)["problem"]
    assert problem["file"] == str(data) and problem["leaf"] == "sparse"
    assert problem["message"].count("chunk 0") == 1, problem["message"]
