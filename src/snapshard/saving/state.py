"""What one save carries from its blocking phase to its background phase, and the seam a
framework's wing fills: `SaveAdapter` (see saving/__init__.py for the call order)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..coordination.rendezvous import (
    Rendezvous,
)
from ..format import (
    Leaf,
)
from ..frameworks import default_save_adapter
from ..options import SaveOptions
from ..planning import WritePlan
from ..storage import Storage
from ..tree import Path
from .incremental import Increment
from .save_array import MeshSpec, SaveArray
from .staging import StagedItem


@dataclass
class SaveTimings:
    """Seconds spent in each phase of one save, as seen by this process."""

    plan_s: float = 0.0
    stage_s: float = 0.0  # device-to-host copies: the blocking phase ends here
    write_s: float = 0.0  # data files and index, fsynced
    commit_s: float = 0.0  # waiting for the others, merge, validate, commit (process 0)
    blocking_s: float = 0.0
    total_s: float = 0.0
    bytes_written: int = 0  # array bytes written by this process (before compression)
    bytes_metadata: int = 0  # what it wrote beside them: checksum tables, chunk records
    bytes_stored: int = 0  # all it put on storage: data files (compressed), records, values
    bytes_staged: int = 0  # host bytes copied in the blocking phase (0: zero-copy views)
    data_files: int = 0  # data files this process wrote (in parallel)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class PreparedSave:
    storage: Storage
    rendezvous: Rendezvous
    leaves: list[Leaf | SaveArray]
    structure: dict[str, Any]
    plan: WritePlan
    items: list[StagedItem]
    overwrite: bool
    options: SaveOptions
    extra: dict[str, Any]
    digests: np.ndarray  # format.records.DIGEST per leaf
    timings: SaveTimings = field(default_factory=SaveTimings)
    increment: Increment | None = None  # content hashes and references (incremental.py)
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])  # this attempt's files
    adapter: SaveAdapter = field(default_factory=default_save_adapter)
    asynchronous: bool = False  # the caller goes on during the background phase
    # indices of the leaves whose copies are compared by fingerprint (copies.py)
    copies: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


class SaveAdapter(Protocol):
    """What a framework's wing supplies to the save executor (jax/save_adapter.py for JAX,
    torch/saving.py for PyTorch): which values are leaves, how they become SaveArrays, how
    this process's planned items reach host memory, an array's mesh for the manifest's
    compact layouts, and what to give back once the save has ended. `trees_differ`: whether
    its leaves were classified for a tree that may differ by process (SaveOptions.trees_differ:
    host values held by this process alone, sub-meshes not widened)."""

    trees_differ: bool

    def is_leaf(self, x: Any) -> bool: ...

    def classify(self, path: Path, value: Any, process_count: int) -> Leaf | SaveArray: ...

    def stage(
        self, arrays: list[tuple[int, SaveArray]], plan: WritePlan, process: int, *, copy: bool
    ) -> tuple[list[StagedItem], int]:
        """This process's items of `plan` on the host, and the host bytes copied for them;
        `copy`: the caller goes on before the items are written (save_async)."""
        ...

    def mesh_of(self, arr: SaveArray) -> MeshSpec | None:
        """The array's device mesh and partition spec where it has one (None: rows)."""
        ...

    def release(self) -> None:
        """Called once the save has ended, however it ended (reused host buffers go back)."""
        ...


class ReplicatedSource:
    """Base of a framework's source of an array that may be assumed equal on every process
    (a plain torch tensor): its value's digest is compared at commit, as a NumPy leaf's is;
    0 where the source is sharded (each process holds its own part). A base class, not a
    runtime-checked Protocol: the check runs once per leaf of every save (5 us against
    0.1 us). A part whose copies on other processes are the save's own assumption (a torch
    DTensor on a sub-mesh, taken to be copied along its root mesh's other dimensions) is
    compared by fingerprint instead (`copy_digests`, saving/copies.py)."""

    copies_assumed = False

    def value_digest(self) -> int:
        raise NotImplementedError

    @classmethod
    def copy_digests(cls, sources: list[ReplicatedSource]) -> list[int]:
        """A fingerprint of each source's part, as the training step left it: the signs of
        the elements `copies.sample_indices` names, in C order (`copies.signs`); one call for
        the sources of one class, so that parts on a device reach the host in one transfer."""
        raise NotImplementedError
