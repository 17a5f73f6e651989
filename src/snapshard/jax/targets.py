"""Restore targets from an init function: its shapes and dtypes, with shardings on a mesh.

`abstract_target(init_fn, mesh, *args)` evaluates `init_fn` abstractly (no array is
allocated) under `jax.set_mesh(mesh)` and returns its output with every array leaf a
`jax.ShapeDtypeStruct` whose sharding is on `mesh`:

- a sharding the computation gives (explicit-axis meshes, `nnx.with_partitioning` under
  `jax.set_mesh`) is kept, moved from the AbstractMesh onto `mesh`;
- a linen `nn.Partitioned` box gives its partition names;
- anything else is replicated on `mesh`.

Flax NNX objects (modules, optimizers, `nnx.Rngs`) are evaluated with `nnx.eval_shape`, so
the target keeps their classes and a restore into it gives the same objects back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .arrays import resolve_target_sharding


def _eval_shape(init_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        from flax import nnx
    except ImportError:
        return jax.eval_shape(init_fn, *args, **kwargs)
    return nnx.eval_shape(init_fn, *args, **kwargs)


def _partitioned_type() -> Any:
    try:
        from flax.core.meta import Partitioned
    except ImportError:
        return None
    return Partitioned


def _set_mesh(mesh: Any) -> Any:
    set_mesh = getattr(jax, "set_mesh", None)  # a context manager (jax.sharding's is a setter)
    if set_mesh is not None:
        return set_mesh(mesh)
    use_mesh = getattr(jax.sharding, "use_mesh", None)
    return use_mesh(mesh) if use_mesh is not None else mesh


def abstract_target(
    init_fn: Callable[..., Any], mesh: jax.sharding.Mesh, *args: Any, **kwargs: Any
) -> Any:
    """The abstract output of `init_fn(*args, **kwargs)`, every array on `mesh` (see the
    module's doc): pass it to `snapshard.load` or a manager's `restore` as the target."""
    with _set_mesh(mesh):
        abstract = _eval_shape(init_fn, *args, **kwargs)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    partitioned = _partitioned_type()

    def place(x: Any, spec: Any = None) -> Any:
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        if spec is not None:
            sharding = jax.sharding.NamedSharding(mesh, spec)
        else:
            sharding = resolve_target_sharding(getattr(x, "sharding", None), mesh)
            if sharding is None:
                sharding = replicated
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    def visit(x: Any) -> Any:
        if partitioned is not None and isinstance(x, partitioned):
            with _set_mesh(mesh):
                spec = x.get_partition_spec()
            return x.replace_boxed(place(x.unbox(), spec))
        return place(x)

    def is_leaf(x: Any) -> bool:
        return isinstance(x, jax.ShapeDtypeStruct) or (
            partitioned is not None and isinstance(x, partitioned)
        )

    return jax.tree_util.tree_map(visit, abstract, is_leaf=is_leaf)
