"""Moving the arrays a read-once restore read on their read shardings onto their targets
(jax/read_once.py): the arrays alone in one program per device assignment, and arrays of one
kind (shape, dtype, read and target sharding: a model's layers) stacked, one collective a
stack.

A program with an output per array costs a collective per array, and XLA compiles it for a
time that grows faster than its arrays (a 10,000-array program compiled for minutes on a
CPU). A stack is one array on the read sharding with a stack axis first, built from the
arrays' host pieces, moved by one identity program onto the target sharding with that axis,
then cut by one program taking its k-th array (k an argument: compiled once for every k,
each device slicing its own shard). Every process moves the same arrays in the same order,
and waits for each stack's collective before the next, so that no process runs two
programs' collectives at once in another order than the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..reading import Request

if TYPE_CHECKING:
    import jax
    from jax.sharding import NamedSharding


class ReadOnce(Protocol):
    """An array read once: its restore's request (onto its target sharding), and the
    sharding it is read on."""

    @property
    def request(self) -> Request: ...

    @property
    def read_sharding(self) -> jax.sharding.Sharding: ...


@lru_cache(maxsize=64)
def _reshard(shardings: tuple[jax.sharding.Sharding, ...]) -> Any:
    """One program moving arrays onto their target shardings (one compilation), all of
    one device assignment."""
    import jax

    return jax.jit(lambda *xs: xs, out_shardings=shardings)


def _reshard_batch(shardings: list[jax.sharding.Sharding], arrays: list[Any]) -> list[Any]:
    """`arrays` moved onto `shardings`: one program per device assignment, since a program
    runs on one (targets on sub-meshes of the job's devices: a mesh of the first devices
    of each process beside one of every device), in the order each first comes, the same
    on every process. Outside any context mesh, which would otherwise have to be the
    targets' own."""
    from .arrays import outside_context_mesh

    groups: dict[tuple[Any, ...], list[int]] = {}
    for k, s in enumerate(shardings):
        groups.setdefault(_device_assignment(s), []).append(k)
    outs: list[Any] = [None] * len(arrays)
    with outside_context_mesh():
        for ks in groups.values():
            moved = _reshard(tuple(shardings[k] for k in ks))(*(arrays[k] for k in ks))
            for k, out in zip(ks, moved, strict=True):
                outs[k] = out
    return outs


def _device_assignment(sharding: jax.sharding.Sharding) -> tuple[Any, ...]:
    """The devices of a sharding in the order a jitted program using it runs on them."""
    found = getattr(sharding, "_device_assignment", None)  # (every sharding of JAX 0.4.14+)
    if found is not None:
        return tuple(found)
    return tuple(sorted(sharding.device_set, key=lambda d: d.id))


# Read-once arrays of one kind (shape, dtype, read and target sharding) move stacked on a
# new first axis, up to this many bytes a stack: one collective and two small programs a
# stack, where a program moving each array costs a collective per array and compiles for a
# time that grows faster than its arrays (minutes for 10,000 arrays on a CPU).
STACK_BYTES = 64 << 20


def stacks(batch: list[int], once: Mapping[int, ReadOnce]) -> list[list[int]]:
    """The batch cut into stacks of one kind within STACK_BYTES (an array of no other's
    kind, or not on NamedShardings, alone), in the order each stack's first array comes:
    the same on every process, whose plans are alike."""
    from jax.sharding import NamedSharding

    open_stacks: dict[tuple[Any, ...], list[int]] = {}
    out: list[list[int]] = []
    for i in batch:
        o = once[i]
        r = o.request
        if not isinstance(o.read_sharding, NamedSharding) or not isinstance(
            r.sharding, NamedSharding
        ):
            out.append([i])
            continue
        key = (tuple(r.saved.shape), r.dtype, o.read_sharding, r.sharding)
        stack = open_stacks.get(key)
        size = math.prod(r.saved.shape) * r.dtype.itemsize
        if stack is None or (len(stack) + 1) * size > STACK_BYTES:
            stack = open_stacks[key] = []
            out.append(stack)
        stack.append(i)
    return out


def _with_stack_axis(sharding: jax.sharding.Sharding) -> NamedSharding:
    """A NamedSharding (what `stacks` stacks) with a whole stack axis first."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert isinstance(sharding, NamedSharding)
    return NamedSharding(sharding.mesh, P(None, *sharding.spec), memory_kind=sharding.memory_kind)


def _stacked(pieces: list[list[np.ndarray]], o: ReadOnce, plan_boxes: tuple[Any, ...]) -> Any:
    """The arrays of one stack as one array on their read sharding with a stack axis first:
    `pieces` are each array's host boxes, in the order of `plan_boxes` (its box plan)."""
    from .arrays import local_device_boxes
    from .assemble import array_from_host_boxes

    r = o.request
    shape = (len(pieces), *r.saved.shape)
    sharding = _with_stack_axis(o.read_sharding)
    boxes = local_device_boxes(sharding, shape)
    at = {(tuple(s), tuple(e)): j for j, (s, e, _) in enumerate(plan_boxes)}
    blocks = [np.stack([p[at[(tuple(s[1:]), tuple(e[1:]))]] for p in pieces]) for s, e, _ in boxes]
    return array_from_host_boxes(shape, sharding, boxes, blocks, r.dtype)


@lru_cache(maxsize=64)
def _unstack(sharding: jax.sharding.Sharding) -> Any:
    """One program taking the k-th array of a stack onto `sharding` (k an argument: one
    compilation for every k; each device slices its own shard, no collective)."""
    import jax
    from jax import lax

    return jax.jit(
        lambda a, k: lax.dynamic_index_in_dim(a, k, 0, keepdims=False), out_shardings=sharding
    )


def move(
    stacks: list[list[int]],
    once: Mapping[int, ReadOnce],
    reqs: Mapping[int, Request],
    built: Mapping[int, Any],
) -> dict[int, Any]:
    """The arrays read on their read shardings (`built`), moved onto their targets: those
    alone in one program, then each stack, waited for before the next (programs whose
    collectives could run at once on a process would not meet the others' in order)."""
    import jax

    from .arrays import outside_context_mesh

    alone = [s[0] for s in stacks if len(s) == 1]
    moved = _reshard_batch([once[i].request.sharding for i in alone], [built[i] for i in alone])
    out = dict(zip(alone, moved, strict=True))
    with outside_context_mesh():
        for stack in (s for s in stacks if len(s) > 1):
            o = once[stack[0]]
            plan = reqs[stack[0]].box_plan
            assert plan is not None
            target = o.request.sharding
            whole = _stacked([built[i] for i in stack], o, plan.boxes)
            (there,) = _reshard((_with_stack_axis(target),))(whole)
            jax.block_until_ready(there)
            take = _unstack(target)
            for k, i in enumerate(stack):
                out[i] = take(there, np.int32(k))
    return out
