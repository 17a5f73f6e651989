"""snapshard's CheckpointManager for torch state: the same manager, with PyTorch's operations.

`TORCH` is the manager's Framework for torch state dicts (see manager/framework.py): leaves
are tensors, DTensors, NumPy arrays and Python values; processes coordinate through
torch.distributed's store when it runs several ranks; saves are staged into reused host
buffers (torch/saving.py) and restored in place (torch/loading.py). Steps on disk are the
same as the JAX manager's, so either manager reads the other's directory.

torch.distributed has no preemption service: `reached_preemption(step)` is true on every
rank at one step, agreed through the store. A rank that saw SIGTERM (`PreemptionPolicy(handle_sigterm=True)`)
or `notify_preemption()` publishes the step it is at, and every rank answers true at its
first step past it (coordination/preemption.py); this needs the ranks to run in step, a
collective between one call and the next, as synchronous training does. In a one-rank job
it is true at once. The node-local tier is JAX's only.
"""

from __future__ import annotations

from ..coordination import Coordinator
from ..manager.framework import Framework
from ..manager.manager import DEFAULT_POLICIES
from ..manager.manager import CheckpointManager as _CheckpointManager
from ..manager.policies import ManagerPolicies
from ..options import ReadOptions, SaveOptions
from ..storage import CheckpointRoot, Location
from .coordination import default_coordinator
from .leaves import is_leaf
from .loading import load
from .saving import start_save

TORCH = Framework(
    name="torch",
    is_leaf=is_leaf,
    coordinator=default_coordinator,
    start_save=start_save,
    load=load,
)


class CheckpointManager(_CheckpointManager):
    """snapshard.CheckpointManager for torch state dicts: `save(step, state_dict)` on every
    rank, `restore(step, target_state_dict)` in place. The options are snapshard's
    manager's (see snapshard.CheckpointManager), but the node-local tier, which is JAX's."""

    def __init__(
        self,
        directory: Location | CheckpointRoot,
        *,
        save_interval_steps: int = 1,
        max_to_keep: int | None = None,
        read_only: bool = False,
        async_save: bool = True,
        incremental: bool = False,
        save_options: SaveOptions = SaveOptions(),
        read_options: ReadOptions = ReadOptions(),
        coordinator: Coordinator | None = None,
        policies: ManagerPolicies = DEFAULT_POLICIES,
    ) -> None:
        super().__init__(
            directory,
            save_interval_steps=save_interval_steps,
            max_to_keep=max_to_keep,
            read_only=read_only,
            async_save=async_save,
            incremental=incremental,
            save_options=save_options,
            read_options=read_options,
            coordinator=coordinator,
            policies=policies,
            framework=TORCH,
        )
