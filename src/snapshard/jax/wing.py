"""The JAX wing as the core sees it: `frameworks.JaxWing`, registered when `snapshard.jax`
is imported. Each operation imports the module that runs it when it is asked (JAX is then
loaded: the core asks only where it met a JAX value), so registering imports no JAX."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from ..coordination.base import Coordinator
    from ..manager.framework import Framework
    from ..save_leaves import SaveArray
    from ..saving import SaveAdapter
    from ..tree import Path


class Wing:
    """frameworks.JaxWing, over jax/arrays.py, jax/assemble.py, jax/save_adapter.py and
    jax/distributed.py."""

    def save_array(self, path: Path, name: str, value: Any) -> SaveArray:
        from .save_adapter import save_array

        return save_array(path, name, value)

    def key_dtype_is_prng(self, dtype: Any) -> bool:
        from .arrays import key_dtype_is_prng

        return key_dtype_is_prng(dtype)

    def is_abstract_mesh(self, mesh: Any) -> bool:
        from .arrays import is_abstract_mesh

        return is_abstract_mesh(mesh)

    def resolve_target_sharding(self, sharding: Any, mesh: Any, *, leaf: str) -> Any:
        from .arrays import resolve_target_sharding

        return resolve_target_sharding(sharding, mesh, leaf=leaf)

    def local_device_boxes(self, sharding: Any, shape: tuple[int, ...]) -> Any:
        from .arrays import local_device_boxes

        return local_device_boxes(sharding, shape)

    def key_array(self, data: np.ndarray, impl: str | None, sharding: Any) -> Any:
        from .arrays import key_array

        return key_array(data, impl, sharding)

    def array_from_host_boxes(
        self, shape: tuple[int, ...], sharding: Any, boxes: Any, hosts: list[np.ndarray]
    ) -> Any:
        from .assemble import array_from_host_boxes

        return array_from_host_boxes(shape, sharding, boxes, hosts)

    def start_cpu_donation_check(self) -> None:
        from .arrays import start_cpu_donation_check

        start_cpu_donation_check()

    def cpu_donation_keeps_memory(self) -> bool:
        from .arrays import cpu_donation_keeps_memory

        return cpu_donation_keeps_memory()

    def save_adapter(self, budget: int | None = None, snapshot: Any = None) -> SaveAdapter:
        from .save_adapter import JaxAdapter

        return JaxAdapter(budget, snapshot)

    def coordinator(self) -> Coordinator | None:
        """jax.distributed's coordinator when it runs several processes, else None."""
        from .distributed import distributed_coordinator

        return distributed_coordinator()

    def framework(self) -> Framework:
        """The manager's `JAX` framework (jax/framework.py)."""
        from .framework import JAX

        return JAX
