"""The read executor: read exactly the bytes each process needs and build its arrays.

For every target box this process holds (replicated boxes once), the overlapping chunks are
found through an index, the overlaps become byte runs, runs are coalesced into reads, and
each read scatters straight into aligned host buffers (preadv), allocated batch by batch.
With verification on (the default), every checksum block a read touches is read whole and
checked. Buffers become jax.Arrays with one batched transfer each (jax/assemble.py);
on the CPU backend the first device of a box takes the buffer without a copy.

The internal API of every reader in the package (snapshard.load, Orbax and safetensors
sources, the torch adapter, read-once): `make_request` says what to build for a leaf,
`execute` reads and builds requests in memory-bounded batches through a `ReadDests`, and
`reader_of` is the `ReadDests` of a snapshard checkpoint. Call order: make_request for each
leaf → execute(requests, reader), which runs the one batch loop (`fill`) over the requests
as `Fill`s → values in request order. The torch wing's fills go through the same loop.

One job per module: host buffers and batching (`buffers.py`), requests and building their
values (`requests.py`, JAX only for jax targets), the restore's seam and its batch loop
(`fills.py`), the pure read plan (`plan.py`), the reads
of one range (`ranges.py`, `windows.py`), where the bytes are and the prefetch
(`prefetch.py`), one batch's reads on the read threads (`reads.py`), the chunk tables and
the readers of a checkpoint (`tables.py`); what every wing's restore shares (`restore.py`) and
when a restore reads once (`read_once_policy.py`).
"""

from .buffers import BATCH_ITEMS, Dest, ReadDests, ReadStats, aligned_empty, batches
from .fills import Expand, fill
from .plan import plan_reads
from .requests import Request, execute, make_request, request_boxes
from .tables import SavedBoxes, chunk_boxes, chunk_tables, reader_of, saved_boxes, table_reader

__all__ = [
    "BATCH_ITEMS",
    "Dest",
    "Expand",
    "ReadDests",
    "ReadStats",
    "Request",
    "SavedBoxes",
    "aligned_empty",
    "batches",
    "chunk_boxes",
    "chunk_tables",
    "execute",
    "fill",
    "make_request",
    "plan_reads",
    "reader_of",
    "request_boxes",
    "saved_boxes",
    "table_reader",
]
