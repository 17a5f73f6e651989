"""The leaf kinds of a manifest: the strings its `kind` fields hold, in one place."""

from __future__ import annotations

from enum import StrEnum


class LeafKind(StrEnum):
    """A manifest leaf's `kind`. Members are str: they compare equal to, and serialize as,
    the strings the format stores."""

    ARRAY = "array"  # an array (jax.Array, np.ndarray, torch.Tensor)
    SCALAR = "scalar"  # a NumPy scalar, restored as one
    PRNG_KEY = "prng_key"  # a typed JAX PRNG key; the stored shape has the key data axis
    VALUE = "value"  # a Python value stored in the manifest itself
    PER_PROCESS = "per_process"  # a value each process kept for itself (v2)


# The kinds an ArrayLeaf may have (the others are values).
ARRAY_KINDS = frozenset({LeafKind.ARRAY, LeafKind.SCALAR, LeafKind.PRNG_KEY})
