"""The manager's `JAX` framework (manager/framework.py): leaves of JAX trees, jax.distributed's
coordinator and preemption service, a save staged through the save executor, `snapshard.load`,
and the warm-up of the CPU donation check."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..coordination import default_coordinator
from ..frameworks import jax_loaded
from ..manager.framework import Framework, StartedSave
from ..options import SaveOptions
from ..saving import finish, prepare
from ..saving.save_array import is_save_leaf
from ..storage import Storage
from ..tree import FlatTree
from .distributed import preemption_sync_point
from .load import load


def _jax_start_save(
    storage: Storage, tree: Any, options: SaveOptions, *, flat: FlatTree, **prepare_args: Any
) -> StartedSave:
    prep = prepare(storage, tree, options, flat=flat, asynchronous=True, **prepare_args)
    return StartedSave(prep.timings, lambda: finish(prep))


def _jax_warm_up() -> None:
    if not jax_loaded():  # no jax.Array can exist yet: NumPy state (or JAX not installed)
        return
    import jax

    from .arrays import start_cpu_donation_check

    if jax.default_backend() == "cpu":  # where saves stage CPU arrays without a copy
        start_cpu_donation_check()


def _local_tier() -> ModuleType:
    from . import local_tier  # (imports JAX: only a manager with a tier asks)

    return local_tier


JAX = Framework(
    name="jax",
    is_leaf=is_save_leaf,
    coordinator=default_coordinator,
    start_save=_jax_start_save,
    load=load,
    preemption_sync_point=preemption_sync_point,
    warm_up=_jax_warm_up,
    local_tier=_local_tier,
    immutable_arrays=True,
)


def jax_framework() -> Framework:
    """`JAX`, for the manager's default (frameworks.JaxWing.framework)."""
    return JAX
