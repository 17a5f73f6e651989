"""The JAX wing: jax.Arrays to and from layouts, host buffers and checkpoints.

`arrays.py` (layouts from shardings, target shardings, typed keys), `assemble.py` (arrays
from host buffers), `save_adapter.py` (`JaxAdapter`, the save executor's adapter), `load.py`
(`snapshard.load`), `read_once.py` (replicated and resharded targets read once across the
job), `distributed.py` (the coordinator over jax.distributed), `ppermute.py` (bytes between
processes over collectives), `framework.py` (the manager's `JAX`), `local_tier.py` (the
manager's node-local tier), `targets.py` (`abstract_target`).

Importing the package registers the wing with the core (`frameworks.register_jax_wing`)
and imports no JAX: a NumPy restore runs where JAX cannot be imported.
"""

from __future__ import annotations

from ..frameworks import register_jax_wing
from .wing import Wing

register_jax_wing(Wing())
