"""The JAX wing as the core sees it: `frameworks.JaxWing`, registered when `snapshard.jax`
is imported. Each operation is imported from the module that runs it when it is first
asked for (JAX is then loaded: the core asks only where it met a JAX value, but for the
save adapter, the coordinator and the manager's framework, whose modules import no JAX),
then kept: later calls go straight to it."""

from __future__ import annotations

import importlib
from typing import Any

# Each operation of frameworks.JaxWing: (module of this package, its name there).
_WHERE = {
    "save_array": ("save_adapter", "save_array"),
    "save_adapter": ("save_adapter", "JaxAdapter"),
    "key_dtype_is_prng": ("arrays", "key_dtype_is_prng"),
    "is_abstract_mesh": ("arrays", "is_abstract_mesh"),
    "resolve_target_sharding": ("arrays", "resolve_target_sharding"),
    "local_device_boxes": ("arrays", "local_device_boxes"),
    "key_array": ("arrays", "key_array"),
    "start_cpu_donation_check": ("arrays", "start_cpu_donation_check"),
    "cpu_donation_keeps_memory": ("arrays", "cpu_donation_keeps_memory"),
    "array_from_host_boxes": ("assemble", "array_from_host_boxes"),
    "coordinator": ("distributed", "distributed_coordinator"),
    "framework": ("manager", "jax_framework"),
}


class Wing:
    """frameworks.JaxWing over this package's modules (see `_WHERE`)."""

    def __getattr__(self, name: str) -> Any:
        if name not in _WHERE:
            raise AttributeError(f"the JAX wing has no operation {name!r}")
        module, attr = _WHERE[name]
        found = getattr(importlib.import_module(f"{__package__}.{module}"), attr)
        setattr(self, name, found)  # (asked again: found on the instance, no lookup)
        return found
