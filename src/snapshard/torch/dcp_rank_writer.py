"""One rank's share of a DCP save (`write_data` of torch/dcp_storage.py): its items staged
on the host, written into its own data files (chunk bytes and their crc32c, as
snapshard.save writes them) and its record file, and its report for the coordinator.
"""

from __future__ import annotations

import contextlib
import io
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ..checksum import crc32c
from ..errors import SnapshardError
from ..format import compression, encoding, record_file_name, records
from ..format.binding import name_key
from ..format.values import encode_value
from ..options import SaveOptions
from ..saving import ChunkColumns, write_chunk_files, write_tuning
from ..saving.commit import remove_own
from ..saving.staging import StagedItem
from ..storage import Storage, is_object_store_url
from .dcp_manifest import DcpStorageError, RankReport
from .dtypes import host_view

_PLAIN = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class SaveNumbering:
    """What every rank needs to write its share: the staging attempt and the leaf numbers
    (which its record file uses); travels to each rank in its plan's `storage_data`."""

    attempt: str
    rank: int  # in DCP's process group
    numbers: dict[str, int]  # fqn -> leaf number
    ndims: list[int]
    ranks: int  # of DCP's process group (1 with no_dist)


class RankWriter:
    """One rank's share of a DCP save: its data files, its record file and its report."""

    def __init__(self, storage: Storage, numbering: SaveNumbering, options: SaveOptions):
        self.storage, self.numbering, self.options = storage, numbering, options
        self.nonce = uuid.uuid4().hex[:8]
        self.sizes: dict[str, int] = {}

    def write(self, items: list[WriteItem], planner: SavePlanner) -> RankReport:
        report = RankReport(self.numbering.attempt, self.numbering.rank, self.nonce, [], 0, 0)
        staged = [s for item in items if (s := self._stage(item, planner, report)) is not None]
        url = self.storage.url
        tuner = None
        count = self.options.writers
        if count is None:
            tuner = write_tuning.counts_for(url, is_object_store_url(url))
            count = tuner.choose(sum(s.nbytes for s in staged))
        t0 = time.perf_counter()
        files = write_chunk_files(self.storage, self.numbering.rank, self.nonce, staged, count,
                                  self._codec_of(staged))  # fmt: skip
        if tuner is not None:
            tuner.record(count, sum(s.nbytes for s in staged), time.perf_counter() - t0)
        report.data_sizes = [f.size for f in files]
        chunks = ChunkColumns.of(files, [])
        codec = records.codecs_of(chunks.fixed["flags"])
        report.codecs = sorted(set(codec[codec != 0].tolist()))
        data = self._records(chunks)
        self.storage.write_bytes(record_file_name(self.numbering.rank, self.nonce), data)
        report.record_size, report.record_crc = len(data), crc32c(data)
        return report

    def _codec_of(self, staged: list[StagedItem]) -> Callable[[StagedItem], int] | None:
        option = self.options.compression
        if option is None:
            return None
        if not compression.available():
            raise SnapshardError("compression needs zstd: install snapshard[compress]")
        dtypes = {s.leaf: s.host.dtype for s in staged if s.host is not None}
        return lambda s: encoding.codec_for(option, dtypes[s.leaf])

    def _stage(
        self, item: WriteItem, planner: SavePlanner, report: RankReport
    ) -> StagedItem | None:
        """The item's bytes on the host (None: nothing to write: a plain value, which goes
        into the report, or a chunk without elements)."""
        fqn = item.index.fqn
        number = self.numbering.numbers.get(fqn)
        if number is None:
            raise DcpStorageError(f"save to {self.storage.url}: leaf {fqn!r} was not planned")
        if item.type == WriteItemType.BYTE_IO:
            lookup = getattr(planner, "lookup_object", None)
            obj = lookup(item.index) if lookup is not None else None
            if lookup is not None and type(obj) in _PLAIN:
                report.values[number] = encode_value(obj, fqn)
                return None
            raw = planner.resolve_data(item)
            data = raw.getvalue() if isinstance(raw, io.BytesIO) else bytes(raw)
            report.pickled[number] = len(data)
            host = np.frombuffer(data, np.uint8)
            start, stop = np.zeros(1, np.int64), np.asarray([len(data)], np.int64)
        else:
            assert item.tensor_data is not None
            tensor = planner.resolve_data(item)
            if not isinstance(tensor, torch.Tensor):
                raise DcpStorageError(f"save to {self.storage.url}: leaf {fqn!r}: no tensor")
            host = host_view(tensor.detach().cpu())
            start = np.asarray(tuple(item.tensor_data.chunk.offsets), np.int64)
            stop = start + np.asarray(tuple(item.tensor_data.chunk.sizes), np.int64)
        self.sizes[fqn] = host.nbytes
        if host.size == 0:
            return None
        return StagedItem(number, fqn, start, stop, host.nbytes, host=host)

    def _records(self, chunks: ChunkColumns) -> bytes:
        ndims = self.numbering.ndims
        segments = chunks.segments(ndims)
        digests = np.zeros(len(ndims), records.DIGEST)  # DCP's plan is global: nothing to compare
        salt = name_key(record_file_name(self.numbering.rank, self.nonce))
        return records.encode(self.numbering.rank, ndims, segments, digests, salt=salt)

    def discard(self) -> None:
        """This rank's files of a save that failed here (best effort: its error matters)."""
        with contextlib.suppress(SnapshardError):
            remove_own(self.storage, self.numbering.rank, self.nonce, settled=True)
