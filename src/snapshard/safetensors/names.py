"""Which leaves a safetensors export writes, and under which tensor names."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedLeafError

PRNG_KEY_POLICIES = ("data", "skip", "refuse")


@dataclass(frozen=True)
class ExportNames:
    r"""Which leaves an export writes, and under which names; the same rules for
    `snapshard.safetensors.save` and `snapshard convert --to safetensors`.

    Names start as the leaf's path joined with '.' (`model.blocks.0.qkv.kernel.value`).

    - `select`: patterns; a leaf is written if any matches its name, as a glob (`*` also
      matches dots) or as a prefix of whole components (`model` selects `model.…`).
      Empty: every leaf.
    - `rename`: (regex, replacement) pairs applied in order with `re.sub` to the selected
      names: `(r"^model\.", "")`, `(r"\.value$", "")`.
    - `transpose`: globs on the renamed names; those tensors are written with their axes
      reversed (a `(in, out)` kernel as a `(out, in)` weight).
    - `prng_keys`: typed PRNG keys are written as their uint32 key data ("data"), left out
      ("skip"), or an error ("refuse").
    """

    select: tuple[str, ...] = ()
    rename: tuple[tuple[str, str], ...] = ()
    transpose: tuple[str, ...] = ()
    prng_keys: str = "data"

    def __post_init__(self) -> None:
        if self.prng_keys not in PRNG_KEY_POLICIES:
            raise ValueError(
                f"prng_keys must be one of {PRNG_KEY_POLICIES}, not {self.prng_keys!r}"
            )
        for pattern, _ in self.rename:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(
                    f"rename pattern {pattern!r} is not a regular expression: {e}"
                ) from None

    def selects(self, name: str) -> bool:
        if not self.select:
            return True
        return any(_selected_by(name, p) for p in self.select)

    def check_selected(self, names: list[str]) -> None:
        """Refuse a select pattern that matches none of `names` (a typo would otherwise
        write a file without the tensors it was meant for)."""
        for p in self.select:
            if not any(_selected_by(n, p) for n in names):
                shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                raise ValueError(
                    f"select pattern {p!r} matches no leaf (leaves: {shown or 'none'})"
                )

    def renamed(self, name: str) -> str:
        for pattern, replacement in self.rename:
            name = re.sub(pattern, replacement, name)
        return name

    def transposes(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.transpose)

    def check_key(self, leaf: str) -> bool:
        """Whether a PRNG key leaf is written (False: skipped); raises under "refuse"."""
        if self.prng_keys == "refuse":
            raise UnsupportedLeafError(
                f"leaf {leaf!r} is a PRNG key; safetensors holds arrays only (pass "
                "prng_keys='data' to write its key data, or 'skip' to leave it out)"
            )
        return self.prng_keys == "data"

    def plan(self, names: list[str]) -> list[tuple[str, str, bool]]:
        """(leaf name, tensor name, transposed) for the selected names, in order; two leaves
        renamed alike are an error naming both."""
        out = []
        seen: dict[str, str] = {}
        for name in names:
            new = self.renamed(name)
            if not new:
                raise ValueError(f"leaf {name!r} is renamed to an empty name")
            if new in seen:
                raise ValueError(
                    f"leaves {seen[new]!r} and {name!r} would both be named {new!r} in safetensors"
                )
            seen[new] = name
            out.append((name, new, self.transposes(new)))
        return out


def _selected_by(name: str, pattern: str) -> bool:
    """A select pattern: the name itself, a prefix of whole components, or a glob."""
    return name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatchcase(name, pattern)


def export_names(
    select: str | list[str] | tuple[str, ...] | None = None,
    rename: dict[str, str] | list[tuple[str, str]] | tuple[tuple[str, str], ...] | None = None,
    transpose: str | list[str] | tuple[str, ...] | None = None,
    prng_keys: str = "data",
) -> ExportNames:
    """An ExportNames from the friendlier forms the public functions accept."""

    def strings(x: Any) -> tuple[str, ...]:
        if x is None:
            return ()
        return (x,) if isinstance(x, str) else tuple(x)

    pairs = tuple(rename.items()) if isinstance(rename, dict) else tuple(rename or ())
    return ExportNames(
        strings(select), tuple((str(a), str(b)) for a, b in pairs), strings(transpose), prng_keys
    )


def leaf_name(path: tuple[Any, ...]) -> str:
    """A leaf's default tensor name: its path joined with '.' ('root' for the root)."""
    return ".".join(str(k) for k in path) or "root"
