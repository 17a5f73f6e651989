"""Moving bytes between processes over JAX's own collectives (ppermute under shard_map).

Used by the multi-tier manager to copy a process's local checkpoint to its peers and back.
Collectives must be issued in the same order on every process, so `exchange` is called on
the caller's thread by every process, with the same permutation. JAX is imported by the
functions that run collectives, not with the module: the coordination package imports no
framework.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jax.sharding import Mesh

DEFAULT_CHUNK_BYTES = 64 << 20


@lru_cache(maxsize=1)
def _process_mesh() -> Mesh:
    """A 1-D mesh of one device per process (each process's lowest-numbered device)."""
    import jax
    from jax.sharding import Mesh

    firsts: dict[int, Any] = {}
    for d in jax.devices():
        if d.process_index not in firsts or d.id < firsts[d.process_index].id:
            firsts[d.process_index] = d
    return Mesh(np.array([firsts[p] for p in sorted(firsts)]), ("process",))


@lru_cache(maxsize=32)
def _permute_fn(perm: tuple[tuple[int, int], ...], chunk: int) -> Any:
    import jax
    from jax.sharding import PartitionSpec

    mesh = _process_mesh()
    spec = PartitionSpec("process")
    return jax.jit(
        jax.shard_map(
            lambda a: jax.lax.ppermute(a, "process", perm), mesh=mesh, in_specs=spec, out_specs=spec
        )
    )


class PendingExchange:
    """Collectives already dispatched; `result()` waits for them and returns what this
    process received (None if it receives nothing)."""

    def __init__(self, received: list[tuple[Any, int]], size: int | None, keep: Any):
        self._received, self._size, self._keep = received, size, keep

    def result(self) -> np.ndarray | None:
        if self._size is None:
            return None
        out = np.empty(self._size, np.uint8)
        at = 0
        for arr, take in self._received:
            out[at : at + take] = np.asarray(arr.addressable_shards[0].data)[0, :take]
            at += take
        self._received, self._keep = [], None
        return out


def start_exchange(
    send: np.ndarray | None,
    perm: Sequence[tuple[int, int]],
    sizes: Sequence[int] | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> PendingExchange:
    """Dispatch the sends of `exchange` and return without waiting for them.

    JAX dispatches the ppermutes asynchronously, in program order on every process, so the
    caller may go on (even run other collectives) while the bytes travel. `sizes` (bytes each
    process sends) saves a collective when every process can compute them. Its programs are
    on the processes' own mesh, whatever mesh the caller has in context (`jax.set_mesh`)."""
    from .arrays import outside_context_mesh

    with outside_context_mesh():
        return _start_exchange(send, perm, sizes, chunk_bytes)


def _start_exchange(
    send: np.ndarray | None,
    perm: Sequence[tuple[int, int]],
    sizes: Sequence[int] | None,
    chunk_bytes: int,
) -> PendingExchange:
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    me, n = jax.process_index(), jax.process_count()
    perm = tuple(sorted((int(a), int(b)) for a, b in perm))
    if not perm:
        return PendingExchange([], None, None)
    if sizes is None:
        size = np.array([0 if send is None else send.nbytes], dtype=np.int64)
        sizes = np.asarray(multihost_utils.process_allgather(size)).reshape(n).tolist()
    sources = {dst: src for src, dst in perm}
    longest = int(max(sizes[src] for src, _ in perm))
    chunk = max(1, min(chunk_bytes, longest))
    mesh = _process_mesh()
    sharding = NamedSharding(mesh, PartitionSpec("process"))
    device = mesh.devices[me]
    flat = np.zeros(0, np.uint8) if send is None else send.reshape(-1).view(np.uint8)
    recv_size = int(sizes[sources[me]]) if me in sources else None
    fn = _permute_fn(perm, chunk)
    received: list[tuple[Any, int]] = []
    for start in range(0, max(longest, 1), chunk):
        part = flat[start : start + chunk]
        if len(part) == chunk:
            piece = part.reshape(1, chunk)
        else:  # the last, short piece (or nothing to send): padded
            piece = np.zeros((1, chunk), np.uint8)
            piece[0, : len(part)] = part
        local = jax.device_put(piece, device)
        got = fn(jax.make_array_from_single_device_arrays((n, chunk), sharding, [local]))
        if recv_size is not None and start < recv_size:
            received.append((got, min(chunk, recv_size - start)))
    return PendingExchange(received, recv_size, flat)


def exchange(
    send: np.ndarray | None,
    perm: Sequence[tuple[int, int]],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> np.ndarray | None:
    """Send this process's `send` bytes along `perm` ((source, destination) process pairs,
    each process at most once as source and once as destination); returns the bytes this
    process receives, or None. Every process calls it with the same `perm`."""
    return start_exchange(send, perm, chunk_bytes=chunk_bytes).result()
