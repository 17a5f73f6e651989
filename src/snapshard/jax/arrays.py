"""jax.Array in and out: layouts from shardings, host views of owned shards, arrays from buffers."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import numpy as np

from ..errors import TargetMismatchError
from ..planning.layout import ArrayLayout, slices_to_box
from ..saving.save_array import MeshSpec

Index = tuple[slice, ...]


@dataclass(frozen=True, eq=False)
class PlacedLayout:
    """A layout and the device of each of its rows."""

    layout: ArrayLayout
    devices: tuple[Any, ...]


@lru_cache(maxsize=4096)
def layout_of(
    shape: tuple[int, ...], itemsize: int, sharding: jax.sharding.Sharding
) -> PlacedLayout:
    """The layout of an array with this shape and sharding; the same object for equal inputs.

    Replica ids number the devices holding the same box in device-id order, the same on
    every process.
    """
    index_map: dict[Any, Index] = dict(sharding.devices_indices_map(shape))
    devices = sorted(index_map, key=lambda d: d.id)
    nd = len(shape)
    starts = np.zeros((len(devices), nd), dtype=np.int64)
    stops = np.zeros((len(devices), nd), dtype=np.int64)
    seen: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    replica = np.zeros(len(devices), dtype=np.int64)
    for r, d in enumerate(devices):
        box = slices_to_box(index_map[d], shape)
        starts[r], stops[r] = box
        replica[r] = seen.get(box, 0)
        seen[box] = replica[r] + 1
    process = np.array([d.process_index for d in devices], dtype=np.int64)
    return PlacedLayout(
        ArrayLayout(shape, itemsize, starts, stops, replica, process), tuple(devices)
    )


def describe_sharding(sharding: jax.sharding.Sharding) -> dict[str, Any]:
    """A JSON description of a sharding, for people and for `metadata` (never re-imported)."""
    out: dict[str, Any] = {"type": type(sharding).__name__, "num_devices": len(sharding.device_set)}
    if isinstance(sharding, jax.sharding.NamedSharding):
        out["mesh"] = {str(k): int(v) for k, v in sharding.mesh.shape.items()}
        out["spec"] = [
            list(p) if isinstance(p, tuple) else (None if p is None else str(p))
            for p in sharding.spec
        ]
    elif not isinstance(sharding, jax.sharding.SingleDeviceSharding):
        out["repr"] = repr(sharding)[:1000]
    return out


def is_prng_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_dtype_is_prng(dtype: Any) -> bool:
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


DeviceBox = tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]
"""A box (start, stop) this process holds and its local devices, in device-id order."""


@lru_cache(maxsize=4096)
def local_device_boxes(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[DeviceBox, ...]:
    """Unique boxes this process must hold for `sharding`, each with its devices; the same
    object for equal inputs (arrays sharded alike ask once)."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Any]] = {}
    index_map: dict[Any, Index] = dict(sharding.addressable_devices_indices_map(shape))
    for d, idx in index_map.items():
        groups.setdefault(slices_to_box(idx, shape), []).append(d)
    return tuple((s, e, tuple(sorted(ds, key=lambda d: d.id))) for (s, e), ds in groups.items())


_cpu_donation_safe: bool | None = None
_cpu_donation_lock = threading.Lock()


def cpu_donation_keeps_memory() -> bool:
    """Whether donating a CPU array leaves alone the memory that others see: a NumPy view of
    its buffer (zero-copy staging of a save, saving/staging.py) and a host buffer that arrays on
    several devices alias (replicas of a restore, `assemble.array_from_host_boxes`). XLA's CPU client does not
    reuse a buffer that something else still references: the output gets a fresh one.
    Checked once per process, on two devices of our own, outside any context mesh; JAX
    arrays are otherwise immutable, so this is all that could change the shared bytes."""
    global _cpu_donation_safe
    with _cpu_donation_lock:
        if _cpu_donation_safe is None:
            with outside_context_mesh(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cpus = jax.local_devices(backend="cpu")[:2]
                raw = np.zeros(1024 + 16, np.float32)  # 64-byte aligned, so that XLA aliases it
                buf = raw[(-raw.ctypes.data % 64) // 4 :][:1024]
                arrays = [jax.device_put(buf, d) for d in cpus]
                own = jax.device_put(np.zeros(1024, np.float32), cpus[0]) + 0  # XLA's buffer
                views = [np.asarray(arrays[0]), np.asarray(own)]
                donate = jax.jit(lambda a: a + 1, donate_argnums=0)
                donate(arrays[-1]).block_until_ready()
                donate(own).block_until_ready()
                _cpu_donation_safe = all(bool(np.all(v == 0)) for v in [buf, *views])
        return _cpu_donation_safe


def start_cpu_donation_check() -> None:
    """Run `cpu_donation_keeps_memory`'s check in the background (its first jit costs a
    fresh process a few tenths of a second): a restore starts it before its reads, a
    CheckpointManager when it is made (so that its first save does not wait for it).

    Not a daemon thread: a process that exits while the check is inside XLA would abort
    in C++ at shutdown; the interpreter joins it first (a fraction of a second at most)."""
    if _cpu_donation_safe is None:
        threading.Thread(target=cpu_donation_keeps_memory, name="snapshard-probe").start()


def spec_axes(entry: Any) -> list[str]:
    """The mesh axes of one entry of a PartitionSpec."""
    if entry is None:
        return []
    if isinstance(entry, tuple | list):
        return [str(a) for a in entry]
    return [str(entry)]


def mesh_and_spec(sharding: Any, ndim: int) -> MeshSpec | None:
    """A NamedSharding as (mesh axis names, axis sizes, process of each mesh position, and
    per array axis the mesh axes it is cut over), for the manifest's compact layouts; None
    for other shardings."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    mesh = sharding.mesh
    devices = getattr(mesh, "devices", None)
    if devices is None:  # an abstract mesh has no devices
        return None
    processes = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(devices).reshape(-1)
    spec = [spec_axes(sharding.spec[i] if i < len(sharding.spec) else None) for i in range(ndim)]
    return (
        tuple(str(a) for a in mesh.axis_names),
        tuple(int(s) for s in devices.shape),
        processes,
        spec,
    )


# --- Independence from the caller's mesh context ------------------------------------------
#
# Flax and JAX teach `with jax.set_mesh(mesh):` around a whole program. Nothing snapshard
# computes may depend on that context: a computation of our own (a probe, building key
# arrays) runs outside it, and a target whose shardings name an AbstractMesh is resolved
# against a concrete mesh before any device is looked at.


@contextmanager
def outside_context_mesh() -> Iterator[None]:
    """Run the body with no context mesh (JAX versions without `jax.set_mesh`: unchanged;
    their `jax.sharding.set_mesh` is a global setter, not a context)."""
    set_mesh = getattr(jax, "set_mesh", None)
    if set_mesh is not None:
        with set_mesh(None):
            yield
        return
    with _outside_use_mesh():
        yield


@contextmanager
def _outside_use_mesh() -> Iterator[None]:
    """JAX 0.5-0.6: leave the context of `jax.sharding.use_mesh` (its two halves)."""
    use_mesh = getattr(jax.sharding, "use_mesh", None)
    try:
        import sys

        from jax._src import mesh as mesh_lib

        use_concrete = getattr(sys.modules[use_mesh.__module__], "use_concrete_mesh", None)
        use_abstract = mesh_lib.use_abstract_mesh
        empty = mesh_lib.empty_abstract_mesh
    except (AttributeError, ImportError, KeyError):
        use_concrete = None
    if use_concrete is None:
        yield
        return
    with use_abstract(empty), use_concrete(None):
        yield


def key_array(data: np.ndarray, impl: str | None, sharding: Any = None) -> jax.Array:
    """Typed PRNG keys wrapping the key data `data` (the whole array, shape key shape + the
    impl's trailing axes), placed on `sharding` (None: the default device).

    Each local device gets its box of the key data, wrapped on that device, and the shards
    are assembled: no jit, so neither the context mesh nor the sharding's kind matters.
    """
    with outside_context_mesh():
        if sharding is None:
            return jax.random.wrap_key_data(jax.device_put(np.asarray(data)), impl=impl)
        shape = tuple(int(s) for s in data.shape)
        key_dtype, data_ndim = _key_probe(impl)
        key_shape = shape[: len(shape) - data_ndim]
        shards = []
        for device, index in sharding.addressable_devices_indices_map(key_shape).items():
            piece = np.ascontiguousarray(data[tuple(index)])
            shards.append(jax.random.wrap_key_data(jax.device_put(piece, device), impl=impl))
        # (the dtype: a sharding of other processes' devices gives this process no shard)
        return jax.make_array_from_single_device_arrays(
            key_shape, sharding, shards, dtype=key_dtype
        )


@lru_cache(maxsize=64)
def _key_probe(impl: str | None) -> tuple[Any, int]:
    """The dtype of keys of `impl`, and the trailing axes of one key's data (1 for every
    built-in impl)."""
    with outside_context_mesh():
        probe = jax.random.key(0, impl=impl)
        return probe.dtype, int(jax.random.key_data(probe).ndim)


def is_abstract_mesh(mesh: Any) -> bool:
    abstract = getattr(jax.sharding, "AbstractMesh", None)
    return abstract is not None and isinstance(mesh, abstract)


def context_mesh() -> Any:
    """The concrete mesh of `jax.set_mesh` (or the legacy `with mesh:`), else None."""
    get_mesh = getattr(jax.sharding, "get_mesh", None)
    if get_mesh is None:  # JAX 0.5-0.6: the concrete half of `jax.sharding.use_mesh`
        try:
            from jax._src import mesh as mesh_lib

            get_mesh = getattr(mesh_lib, "get_concrete_mesh", None)
        except ImportError:
            get_mesh = None
    if get_mesh is not None:
        try:
            mesh = get_mesh()
        except Exception:  # not inside any mesh context on some JAX versions
            mesh = None
        if mesh is not None and not getattr(mesh, "empty", False) and mesh.devices.size:
            return mesh
    try:
        from jax._src import mesh as mesh_lib  # the legacy `with mesh:` context

        env_mesh = mesh_lib.thread_resources.env.physical_mesh
    except Exception:
        return None
    return None if env_mesh.empty else env_mesh


def resolve_target_sharding(sharding: Any, mesh: Any = None, *, leaf: str | None = None) -> Any:
    """A sharding a restore can place arrays on.

    A `NamedSharding` on an `AbstractMesh` (what `nnx.eval_shape` or `jax.eval_shape` give
    under `jax.set_mesh`) names axes but no devices: it is rebuilt on `mesh` if given, else
    on the concrete mesh in context. The concrete mesh must have the abstract one's axis
    names and sizes. Any other sharding (or None) is returned unchanged.
    """
    if not isinstance(sharding, jax.sharding.NamedSharding) or not is_abstract_mesh(sharding.mesh):
        return sharding
    where = f"leaf {leaf!r}: " if leaf is not None else ""
    abstract = sharding.mesh
    concrete = mesh if mesh is not None else context_mesh()
    wanted = dict(abstract.shape)
    if concrete is None:
        raise TargetMismatchError(
            f"{where}the target's sharding is on an AbstractMesh {_axes(wanted)} (from "
            "eval_shape under jax.set_mesh?), which names no devices; call load inside "
            "`with jax.set_mesh(mesh):` or pass `mesh=` with a concrete jax.sharding.Mesh "
            "of those axes"
        )
    if is_abstract_mesh(concrete):
        raise TargetMismatchError(
            f"{where}mesh= must be a concrete jax.sharding.Mesh, not an AbstractMesh"
        )
    have = dict(concrete.shape)
    if have != wanted:
        source = "mesh=" if mesh is not None else "the mesh in context"
        raise TargetMismatchError(
            f"{where}the target's sharding is on an AbstractMesh {_axes(wanted)}, {source} "
            f"has {_axes(have)}; pass a mesh with the same axis names and sizes"
        )
    kwargs: dict[str, Any] = {}
    memory_kind = getattr(sharding, "memory_kind", None)
    if memory_kind is not None:
        kwargs["memory_kind"] = memory_kind
    return jax.sharding.NamedSharding(concrete, sharding.spec, **kwargs)


def _axes(shape: dict[str, int]) -> str:
    return "(" + ", ".join(f"{k}={v}" for k, v in shape.items()) + ")"
