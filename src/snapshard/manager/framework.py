"""What the CheckpointManager asks of a framework: the seam between its policies and the arrays.

The manager's policies, retention, lifecycle, asynchronous saves and commit protocol do not
depend on the arrays being jax.Arrays or torch tensors; only these things do, and a
`Framework` names them:

- `is_leaf`: which values of a tree are leaves (flattening);
- `coordinator`: how processes agree when no coordinator is passed (jax.distributed's
  coordination service, or torch.distributed's store);
- `start_save`: the blocking phase of a save into one step's storage, returning a
  `StartedSave` whose `finish()` the manager runs in the background;
- `load`: restoring a step into a target (or without one);
- `preemption_sync_point`: a framework's agreement on the step to save at when the job is
  preempted (True at that step on every process), returning None while its service does
  not run; or None where there is none. Without one, the processes of a multi-process job
  agree through the coordinator (coordination/preemption.py), a single process decides
  from SIGTERM or `notify_preemption`;
- `warm_up`: one-time work that a first save's blocking phase would otherwise pay, started
  in the background when a manager is made (JAX: the check that zero-copy staging of CPU
  arrays is safe, whose first jit costs a fresh process 0.2 s), or None.

What the framework supports beyond these: the node-local tier (`local_tier`: a function
giving the tier's module, with `LocalStore`, `stage_local`, `TierRestore` and
`restore_from_tiers`, imported when a manager uses the tier: jax/local_tier.py, built on
jax.Array snapshots and collectives; None where there is none) and the identity shortcut of
incremental saves (`immutable_arrays`: a leaf that is the very array object saved last time
holds the same bytes, true of jax.Arrays, not of tensors that the optimizer updates in
place).

`snapshard.jax.manager.JAX` is the default; `snapshard.torch.TORCH` is PyTorch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..coordination import Coordinator
from ..options import ReadOptions, SaveOptions
from ..reading import ReadStats
from ..saving import SaveTimings
from ..storage import Storage
from ..tree import FlatTree


@dataclass(frozen=True)
class StartedSave:
    """A save past its blocking phase: its timings so far, and the background phase (write,
    report, commit), which returns the final timings or raises."""

    timings: SaveTimings
    finish: Callable[[], SaveTimings]


class StartSave(Protocol):
    """A save's blocking phase into one step's storage. It must snapshot every byte the
    save writes before returning (the caller goes on training). `base` and `identical`,
    passed only for an incremental save, are saving.prepare's."""

    def __call__(
        self,
        storage: Storage,
        tree: Any,
        options: SaveOptions,
        /,
        *,
        flat: FlatTree,
        coordinator: Coordinator,
        extra: dict[str, Any],
        snapshot: Any,
    ) -> StartedSave: ...


class Load(Protocol):
    """A restore of one step into `target` (None: the saved tree), filling `stats`. The
    framework's own keywords that the manager's `restore` passes through come beside."""

    def __call__(
        self, storage: Storage, target: Any, options: ReadOptions, /, *, stats: ReadStats
    ) -> Any: ...


@dataclass(frozen=True)
class Framework:
    """The framework-specific operations of a CheckpointManager (see the module docstring)."""

    name: str
    is_leaf: Callable[[Any], bool]
    coordinator: Callable[[], Coordinator]
    start_save: StartSave
    load: Load
    preemption_sync_point: Callable[[int], bool | None] | None = None
    warm_up: Callable[[], None] | None = None
    local_tier: Callable[[], Any] | None = None
    immutable_arrays: bool = False


def tier_of(framework: Framework) -> Any:
    """The framework's node-local tier (its module), which a manager with a tier uses."""
    if framework.local_tier is None:
        raise ValueError(f"the local tier is not available for {framework.name} state")
    return framework.local_tier()
