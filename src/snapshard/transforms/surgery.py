"""Model surgery: small composable transformations of a flat name -> lazy array mapping.

Each function returns a transform: a callable from a mapping to a new mapping. Compose them
with `chain` and pass the result to `load(..., transform=...)`; nothing is read until a
shard is built, and then only the source bytes that shard needs.

Names are matched with `re.fullmatch`. Templates (`out`) use the match's groups (`\\1`,
`\\g<name>`), as in `re.sub`. Tensors a pattern does not match pass through unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from . import virtual as v
from .virtual import VArray

Transform = Callable[[Mapping[str, VArray]], dict[str, VArray]]


def chain(*transforms: Transform) -> Transform:
    """Apply transforms left to right."""

    def apply(arrays: Mapping[str, VArray]) -> dict[str, VArray]:
        out = dict(arrays)
        for t in transforms:
            out = t(out)
        return out

    return apply


def _put(out: dict[str, VArray], name: str, x: VArray, what: str) -> None:
    if name in out:
        raise ValueError(f"{what}: the result name {name!r} is already taken")
    out[name] = x


def _each(pattern: str, fn: Callable[[re.Match[str], VArray], VArray], what: str) -> Transform:
    """Apply fn to every array whose name matches; fail when nothing matches (a typo)."""
    rx = re.compile(pattern)

    def apply(arrays: Mapping[str, VArray]) -> dict[str, VArray]:
        out = dict(arrays)
        hits = 0
        for name, x in arrays.items():
            if m := rx.fullmatch(name):
                out[name] = fn(m, x)
                hits += 1
        if not hits:
            raise ValueError(f"{what}: no tensor matches {pattern!r}")
        return out

    return apply


def rename(pattern: str, repl: str) -> Transform:
    """Rename every matching tensor to the expansion of `repl` (e.g. strip a prefix)."""
    rx = re.compile(pattern)

    def apply(arrays: Mapping[str, VArray]) -> dict[str, VArray]:
        out: dict[str, VArray] = {}
        for name, x in arrays.items():
            m = rx.fullmatch(name)
            _put(out, m.expand(repl) if m else name, x, f"rename {pattern!r}")
        return out

    return apply


def drop(pattern: str) -> Transform:
    """Remove every matching tensor (e.g. rotary caches the model recomputes)."""
    rx = re.compile(pattern)
    return lambda arrays: {n: x for n, x in arrays.items() if not rx.fullmatch(n)}


def _groups(
    arrays: Mapping[str, VArray], pattern: str, out: str, key: str
) -> dict[str, dict[str, tuple[str, VArray]]]:
    """Matching tensors grouped by their expanded output name, keyed by the group `key`."""
    rx = re.compile(pattern)
    if key not in rx.groupindex:
        raise ValueError(f"pattern {pattern!r} needs a named group (?P<{key}>...)")
    groups: dict[str, dict[str, tuple[str, VArray]]] = {}
    for name, x in arrays.items():
        if m := rx.fullmatch(name):
            groups.setdefault(m.expand(out), {})[m.group(key)] = (name, x)
    if not groups:
        raise ValueError(f"no tensor matches {pattern!r}")
    return groups


def _merge(
    pattern: str,
    out: str,
    key: str,
    members: Callable[[str, dict[str, VArray]], list[VArray]],
    combine: Callable[[list[VArray], str], VArray],
    what: str,
) -> Transform:
    """Replace each group of matching tensors (see _groups) by one combined array."""

    def apply(arrays: Mapping[str, VArray]) -> dict[str, VArray]:
        groups = _groups(arrays, pattern, out, key)
        result = {n: x for n, x in arrays.items() if not re.fullmatch(pattern, n)}
        for name, group in groups.items():
            xs = members(name, {k: x for k, (_, x) in group.items()})
            _put(result, name, combine(xs, f"{what} into {name!r}"), what)
        return result

    return apply


def fuse(pattern: str, out: str, order: Sequence[str], axis: int = 0) -> Transform:
    """Concatenate tensors that differ only in the named group `part`, in the given order.

    fuse(r"(.*)\\.(?P<part>gate|up)_proj\\.weight", r"\\1.gate_up.weight", ["gate", "up"])
    """

    def members(name: str, parts: dict[str, VArray]) -> list[VArray]:
        if sorted(parts) != sorted(order):
            raise ValueError(
                f"fuse into {name!r}: parts {sorted(parts)} found, {list(order)} expected"
            )
        return [parts[p] for p in order]

    return _merge(pattern, out, "part", members, lambda xs, w: v.concatenate(xs, axis, w), "fuse")


def stack(pattern: str, out: str, axis: int = 0) -> Transform:
    """Stack tensors numbered 0..N-1 by the named group `i` along a new axis (e.g. experts).

    stack(r"(.*)\\.experts\\.(?P<i>\\d+)\\.w1\\.weight", r"\\1.experts.w1")
    """

    def members(name: str, numbered: dict[str, VArray]) -> list[VArray]:
        idx = sorted(numbered, key=int)
        if [int(i) for i in idx] != list(range(len(idx))):
            raise ValueError(
                f"stack into {name!r}: indices {[int(i) for i in idx]} are not 0..{len(idx) - 1}"
            )
        return [numbered[i] for i in idx]

    return _merge(pattern, out, "i", members, lambda xs, w: v.stack(xs, axis, w), "stack")


def split(pattern: str, outs: Sequence[str], sizes: Sequence[int], axis: int = 0) -> Transform:
    """Split each matching tensor along axis into pieces of the given sizes, named by `outs`."""
    rx = re.compile(pattern)
    if len(outs) != len(sizes):
        raise ValueError("split: one output name per size")

    def apply(arrays: Mapping[str, VArray]) -> dict[str, VArray]:
        result: dict[str, VArray] = {}
        hits = 0
        for name, x in arrays.items():
            m = rx.fullmatch(name)
            if not m:
                _put(result, name, x, "split")
                continue
            hits += 1
            ax = axis % max(x.ndim, 1)
            if sum(sizes) != x.shape[ax]:
                raise ValueError(
                    f"split {name!r}: sizes {list(sizes)} do not add up to {x.shape[ax]}"
                )
            start = 0
            for o, n in zip(outs, sizes, strict=True):
                _put(result, m.expand(o), v.take(x, ax, start, start + n), "split")
                start += n
        if not hits:
            raise ValueError(f"split: no tensor matches {pattern!r}")
        return result

    return apply


def repeat(pattern: str, repeats: int, axis: int = 0, block: int = 1) -> Transform:
    """Repeat each block of `block` entries along axis `repeats` times, in place.

    For grouped-query attention, repeat(r".*\\.k_proj\\.weight", 4, axis=0, block=head_dim)
    gives every query head its own copy of its key head (HF's repeat_kv order).
    """
    return _each(pattern, lambda m, x: v.repeat(x, repeats, axis, block), "repeat")


def transpose(pattern: str, perm: Sequence[int] | None = None) -> Transform:
    """Permute axes (reverse them when perm is None), e.g. torch Linear weights to (in, out)."""
    return _each(
        pattern,
        lambda m, x: v.transpose(x, perm if perm is not None else range(x.ndim)[::-1]),
        "transpose",
    )


def reshape(pattern: str, shape: Sequence[int]) -> Transform:
    """Reshape (one -1 allowed). Free on a stored tensor; on a composite, exact per shard when
    the shard's box is a contiguous range of every group of merged/split axes."""
    return _each(pattern, lambda m, x: v.reshape(x, shape), "reshape")


def cast(pattern: str, dtype: Any) -> Transform:
    """Convert the dtype on the host after reading (bytes read are the stored ones)."""
    return _each(pattern, lambda m, x: v.cast(x, dtype), "cast")
