"""Verified local reads: cache-sized pieces when the bytes are in the page cache, large
pieces when they must come from the device (`Storage.in_memory`)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

import snapshard
from snapshard.errors import ChecksumMismatchError
from snapshard.format import checksum_block
from snapshard.storage.local import LocalStorage


@pytest.fixture
def saved(tmp_path):
    x = (np.arange(10 << 20, dtype=np.float32) % 1009).reshape(2560, 4096)  # 40 MiB, one chunk
    snapshard.save(tmp_path / "c", {"x": x})
    return tmp_path / "c", x


def _piece_sizes(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = LocalStorage.read_into

    def spy(self, name, offset, buffers):
        if name.startswith("data/"):
            sizes.append(sum(len(b) for b in buffers))
        return real(self, name, offset, buffers)

    monkeypatch.setattr(LocalStorage, "read_into", spy)
    return sizes


@pytest.mark.parametrize("cached", [True, False])
def test_the_piece_size_follows_the_page_cache(saved, monkeypatch, cached):
    path, x = saved
    monkeypatch.setattr(LocalStorage, "in_memory", lambda self, name, offset: cached)
    sizes = _piece_sizes(monkeypatch)
    out = snapshard.load(path)
    assert np.array_equal(out["x"], x)
    data = [s for s in sizes if s > 4096]  # the checksums come in a read of their own
    piece = LocalStorage.read_piece_bytes if cached else LocalStorage.cold_read_piece_bytes
    assert piece is not None
    block = checksum_block(x.nbytes)  # pieces are whole checksum blocks
    assert max(data) == max(block, piece // block * block) and sum(data) == x.nbytes


def test_damage_is_found_in_large_pieces_too(saved, monkeypatch):
    path, _ = saved
    monkeypatch.setattr(LocalStorage, "in_memory", lambda self, name, offset: False)
    f = next((path / "data").iterdir())
    raw = bytearray(f.read_bytes())
    raw[30 << 20] ^= 0x10  # inside the second large piece
    f.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match="leaf 'x'"):
        snapshard.load(path)


def test_in_memory_tells_cached_bytes(saved):
    path, x = saved
    f = next((path / "data").iterdir())
    name = "data/" + f.name
    fd = os.open(f, os.O_RDONLY)
    try:  # some filesystems (tmpfs) cannot tell: in_memory then says True, as documented
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
    except OSError as e:
        if e.errno == errno.EOPNOTSUPP:
            pytest.skip(f"{path}: this filesystem does not support RWF_NOWAIT reads")
    finally:
        os.close(fd)
    storage = LocalStorage(path)
    try:
        np.asarray(snapshard.load(storage)["x"])  # read: in the page cache now
        assert storage.in_memory(name, 0)
        assert storage.in_memory(name, x.nbytes - 1)
        assert not storage.in_memory(name, 1 << 40)  # past the end: nothing to read
    finally:
        storage.close()
