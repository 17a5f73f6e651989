"""The node-local tier's configuration and the reports of what each tier did: plain data,
free of the JAX machinery of local_tier.py, so that every manager can name them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class TierReport:
    """What one step's save cost this process, per tier (seconds and bytes)."""

    blocking_s: float = 0.0  # what the training step waited for
    local_snapshot_s: float = 0.0  # the host snapshot of every local box
    peer_dispatch_s: float = 0.0  # dispatching the copies to peers (collectives)
    peer_transfer_wait_s: float = 0.0  # background: waiting for the peers' bytes
    local_save_s: float = 0.0  # background: writing the own and peer copies
    local_bytes: int = 0
    persistent_save_s: float = 0.0  # background: the persistent save after the blocking phase
    persistent_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class RestoreReport:
    """Which tier served a manager's restore, how long it took and what it read."""

    tier: str = ""  # "local", "peer" or "persistent"
    step: int | None = None
    bytes_read_persistent: int = 0
    bytes_read_local: int = 0
    bytes_from_peers: int = 0
    seconds: float = 0.0
    skipped: tuple[str, ...] = ()  # copies that failed verification and were passed over

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["skipped"] = list(self.skipped)
        return out


@dataclass(frozen=True)
class LocalTier:
    """Configuration of the local tier of a CheckpointManager.

    directory: node-local storage (a fast disk or a RAM disk), the same path on every host.
    interval: save to it every `interval` steps. max_to_keep: local steps kept per process.
    replicas: copies of each process's shards on other hosts. processes_per_host: how many
    consecutive process indices share a host (JAX's usual layout is host-major).
    """

    directory: str
    interval: int = 1
    max_to_keep: int = 2
    replicas: int = 1
    processes_per_host: int = 1

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0
