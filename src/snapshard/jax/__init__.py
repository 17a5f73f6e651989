"""The JAX wing: jax.Arrays to and from layouts, host buffers and checkpoints (its modules:
docs/design.md, "Folders"). Importing it registers the wing with the core
(`frameworks.register_jax_wing`) and imports no JAX: a NumPy restore runs without JAX."""

from __future__ import annotations

from typing import cast

from ..frameworks import JaxWing, register_jax_wing
from .wing import Wing

register_jax_wing(cast(JaxWing, Wing()))
