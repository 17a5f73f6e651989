"""crc32c checksums (hardware-accelerated), per checksum block of a chunk."""

from __future__ import annotations

import crc32c as _crc32c


def crc32c(data: memoryview | bytes, value: int = 0) -> int:
    """crc32c of `data`, continuing from `value`."""
    return int(_crc32c.crc32c(data, value))


def block_crcs(data: memoryview, block: int) -> list[int]:
    return [crc32c(data[i : i + block]) for i in range(0, len(data), block)]


class BlockVerifier:
    """Checks bytes fed in file order against the crcs of consecutive checksum blocks.

    Feed pieces with `update`; whenever a block is complete its crc is compared, and the
    first mismatch is reported as (block number, expected, actual).
    """

    def __init__(self, expected: list[int], first_block: int, block: int, total: int):
        self.expected = expected
        self.block_no = first_block
        self.block = block
        self.left_in_range = total
        self.left_in_block = min(block, total)
        self.crc = 0
        self.mismatch: tuple[int, int, int] | None = None

    def update(self, piece: memoryview) -> None:
        while len(piece) and self.mismatch is None:
            n = min(len(piece), self.left_in_block)
            self.crc = crc32c(piece[:n], self.crc)
            piece = piece[n:]
            self.left_in_block -= n
            self.left_in_range -= n
            if self.left_in_block == 0:
                want = self.expected[self.block_no]
                if want != self.crc:
                    self.mismatch = (self.block_no, want, self.crc)
                self.block_no += 1
                self.crc = 0
                self.left_in_block = min(self.block, self.left_in_range)
