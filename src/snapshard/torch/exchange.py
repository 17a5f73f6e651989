"""Reshards read once for torch: each rank reads a band of whole rows of a target that cuts
the saved rows, and the bands move into the target shards through shared memory where the
ranks share a host, else by one all-to-all over torch.distributed per batch
(planning/exchange.py says when and why).

Call order, on every rank, with the same target and the same `memory_budget`:

1. torch/band_plan.py: the exchanges (`plan`) and their batches (`batches_of`), cut for
   shared memory.
2. `SharedBands.open(rv, batches)` (a collective): None on every rank when the ranks cannot
   share memory, and the batches are cut again for the all-to-all.
3. `Exchange(regions, read, store, rv, scratch, shared).run(turn, batch, error)` per
   batch (number `turn`): read this rank's bands (into its slot of shared memory, or a
   buffer) and pack what it sends; agree through the rendezvous that every rank got that
   far (and through every earlier step), so that a failure fails every rank, naming it,
   instead of a rank waiting in a collective; then `store` each piece into its target
   region, cast to its dtype: copied out of its reader's slot, or received by
   `all_to_all_single`. A failure after the agreement is returned, for the caller to
   report at its next one. The buffers (`Scratch`) are reused from batch to batch.

The bytes travel in the saved dtype, through CPU buffers, whatever device the target is
on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..coordination.peer_memory import PeerMemory
from ..coordination.rendezvous import Rendezvous, all_succeeded
from ..planning.layout import Box
from ..reading import Dest, ReadDests, aligned_empty
from .band_plan import BandLeaf

# Stores a piece (NumPy, the saved dtype) into a view of a target region.
Store = Callable[[Any, np.ndarray], None]


def _by_peer(rows: np.ndarray, peers: np.ndarray, world: int) -> list[np.ndarray]:
    """`rows` (ordered by their peer in `peers`) split by peer, 0 to world - 1."""
    cuts = np.searchsorted(peers[rows], np.arange(world + 1))
    return [rows[cuts[p] : cuts[p + 1]] for p in range(world)]


# (position in the batch, the exchange, message index)
_Piece = tuple[int, BandLeaf, int]


class _Pieces:
    """This rank's pieces of one batch: per peer, those it sends and receives, in the one
    order of every rank (batch order, then the messages' order)."""

    def __init__(self, batch: list[BandLeaf], rank: int, world: int) -> None:
        self.sends: list[list[_Piece]] = [[] for _ in range(world)]
        self.recvs: list[list[_Piece]] = [[] for _ in range(world)]
        for k, b in enumerate(batch):
            m = b.msgs
            sent = _by_peer(m.between(sender=rank), m.receiver, world)
            got = _by_peer(m.between(receiver=rank), m.sender, world)
            for q in range(world):
                self.sends[q] += [(k, b, int(i)) for i in sent[q]]
                self.recvs[q] += [(k, b, int(i)) for i in got[q]]
        self.own = self.sends[rank]  # this rank's part of its own bands
        self.sends[rank], self.recvs[rank] = [], []

    @staticmethod
    def sizes(per_peer: list[list[_Piece]]) -> list[int]:
        return [sum(b.piece_bytes(m) for _, b, m in ps) for ps in per_peer]


@dataclass(frozen=True)
class Exchange:
    """What the exchanges of one load share: `regions` maps (target leaf, box) to the view
    of the target that this rank's box is; `read` reads from storage, `store` puts a piece
    into a region; the load's rendezvous; the buffers reused from batch to batch; and the
    shared memory the bands go through (None: the all-to-all)."""

    regions: dict[tuple[int, Box], Any]
    read: ReadDests
    store: Store
    rv: Rendezvous
    scratch: Scratch
    shared: SharedBands | None = None

    def run(
        self, turn: int, batch: list[BandLeaf], error: BaseException | None
    ) -> tuple[int, BaseException | None]:
        """Step 3 for batch number `turn`: (bytes received from peers, the error this rank
        met after the agreement, to report at the next one). Raises on every rank if any
        rank failed before the agreement (`error`: a failure of an earlier step of this
        rank)."""
        rank, world = self.rv.coord.process_index, self.rv.coord.process_count
        pieces = _Pieces(batch, rank, world)
        step = f"bands/{turn}"
        if self.shared is not None:
            return self._through_memory(batch, pieces, step, error, self.shared, turn)
        return self._all_to_all(batch, pieces, step, error)

    def _all_to_all(
        self, batch: list[BandLeaf], pieces: _Pieces, step: str, error: BaseException | None
    ) -> tuple[int, BaseException | None]:
        """Read this rank's bands into a buffer, pack what it sends, agree, then one
        `all_to_all_single` and store what came."""
        rank = self.rv.coord.process_index
        send_sizes, recv_sizes = pieces.sizes(pieces.sends), pieces.sizes(pieces.recvs)
        bands: dict[int, np.ndarray] = {}
        send = recv = np.empty(0, np.uint8)
        if error is None:
            try:  # everything that can fail on one rank, before the others enter the collective
                buf = self.scratch.get("bands", band_buffer_bytes(batch, rank))
                bands = _read_bands(batch, self.read, rank, buf)
                send = self.scratch.get("send", sum(send_sizes))
                recv = self.scratch.get("recv", sum(recv_sizes))
                at = 0
                for ps in pieces.sends:
                    for k, b, m in ps:
                        piece = b.band_piece(bands[k], rank, m)
                        n = piece.nbytes
                        np.copyto(send[at : at + n].view(piece.dtype).reshape(piece.shape), piece)
                        at += n
            except Exception as e:
                error = e
        all_succeeded(self.rv, step, error)
        if any(b.moves for b in batch):  # the same answer on every rank
            torch.distributed.all_to_all_single(
                torch.from_numpy(recv), torch.from_numpy(send), recv_sizes, send_sizes
            )
        try:
            for k, b, m in pieces.own:
                self.store(b.target_view(self.regions, m), b.band_piece(bands[k], rank, m))
            at = 0
            for ps in pieces.recvs:
                for _, b, m in ps:
                    n = b.piece_bytes(m)
                    piece = recv[at : at + n].view(b.dtype).reshape(b.piece_shape(m))
                    self.store(b.target_view(self.regions, m), piece)
                    at += n
        except Exception as e:
            return int(recv.nbytes), e
        return int(recv.nbytes), None

    def _through_memory(
        self,
        batch: list[BandLeaf],
        pieces: _Pieces,
        step: str,
        error: BaseException | None,
        shared: SharedBands,
        turn: int,
    ) -> tuple[int, BaseException | None]:
        """Read this rank's bands into its slot, agree that every rank did, then copy every
        piece this rank holds out of its reader's slot."""
        rank = self.rv.coord.process_index
        if error is None:
            try:
                _read_bands(batch, self.read, rank, shared.mine(turn))
            except Exception as e:
                error = e
        all_succeeded(self.rv, step, error)
        received = 0
        try:  # (pieces.recvs[rank] is empty: this rank's own pieces are pieces.own)
            for sender, ps in [(rank, pieces.own), *enumerate(pieces.recvs)]:
                if not ps:
                    continue
                bands = _bands_in(batch, shared.of(sender, turn), sender)
                for k, b, m in ps:
                    self.store(b.target_view(self.regions, m), b.band_piece(bands[k], sender, m))
                    received += b.piece_bytes(m) if sender != rank else 0
        except Exception as e:
            return received, e
        return received, None


class SharedBands:
    """Every rank's bands in shared memory (coordination/peer_memory.py), in two slots per
    rank taken by turns: batch k is written into slot k % 2. A rank writes a slot again
    two batches later, after the agreement of the batch between, which every rank reaches
    only once it has copied out of that slot: one agreement per batch suffices."""

    def __init__(self, memory: PeerMemory, slot_bytes: list[int]) -> None:
        self.memory, self.slot_bytes = memory, slot_bytes

    @classmethod
    def open(cls, rv: Rendezvous, batches: list[list[BandLeaf]]) -> SharedBands | None:
        """Collective: the slots of every rank, or None on every rank (no shared memory
        between all of them: the exchange then uses the collective). The segments are kept
        for the next load (PeerMemory's `keep`)."""
        world = rv.coord.process_count
        slot = [max((band_buffer_bytes(b, q) for b in batches), default=0) for q in range(world)]
        memory = PeerMemory.open(rv.sub("shared"), [2 * n for n in slot], keep=True)
        return None if memory is None else cls(memory, slot)

    def _slot(self, whole: np.ndarray, rank: int, turn: int) -> np.ndarray:
        n = self.slot_bytes[rank]
        return whole[(turn % 2) * n : (turn % 2 + 1) * n]

    def mine(self, turn: int) -> np.ndarray:
        return self._slot(self.memory.mine(), self.memory.rank, turn)

    def of(self, rank: int, turn: int) -> np.ndarray:
        return self._slot(self.memory.of(rank), rank, turn)

    def close(self) -> None:
        self.memory.close()


class Scratch:
    """The buffers of a load's exchanges, grown on demand and reused from one to the next."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, nbytes: int) -> np.ndarray:
        buf = self._bufs.get(name)
        if buf is None or len(buf) < nbytes:
            buf = self._bufs[name] = aligned_empty(nbytes)
        return buf[:nbytes]


def _band_layout(batch: list[BandLeaf], rank: int) -> list[tuple[tuple[int, ...], int]]:
    """(shape, byte offset) of `rank`'s band of every exchange of the batch in its buffer,
    each band 64-byte aligned; the same on every rank."""
    out, at = [], 0
    for b in batch:
        start, stop = b.band(rank)
        shape = tuple(e - s for s, e in zip(start, stop, strict=True))
        out.append((shape, at))
        at += -(-math.prod(shape) * b.itemsize // 64) * 64
    return out


def band_buffer_bytes(batch: list[BandLeaf], rank: int) -> int:
    """The bytes `rank`'s bands of a batch take in its buffer."""
    shape, at = _band_layout(batch, rank)[-1] if batch else ((), 0)
    return at + (math.prod(shape) * batch[-1].itemsize if batch else 0)


def _bands_in(batch: list[BandLeaf], buf: np.ndarray, rank: int) -> dict[int, np.ndarray]:
    """`rank`'s band of every exchange of the batch (by position), as views of `buf`."""
    bands = {}
    for k, (b, (shape, at)) in enumerate(zip(batch, _band_layout(batch, rank), strict=True)):
        part = buf[at : at + math.prod(shape) * b.itemsize]
        bands[k] = part.view(b.dtype).reshape(shape)
    return bands


def _read_bands(
    batch: list[BandLeaf], read: ReadDests, rank: int, buf: np.ndarray
) -> dict[int, np.ndarray]:
    """This rank's band of every exchange of the batch, read from storage in the saved
    dtype into `buf` (band_buffer_bytes long)."""
    bands = _bands_in(batch, buf, rank)
    dests = []
    for k, b in enumerate(batch):
        if bands[k].nbytes:
            start, stop = b.band(rank)
            flat = bands[k].reshape(-1).view(np.uint8)
            dests.append(Dest(b.saved, np.asarray(start), np.asarray(stop), flat))
    read(dests)
    return bands
