"""The package's architecture, read from its imports: every import statement counts, at
module level, inside functions and under TYPE_CHECKING alike (an import inside a function
is a dependency all the same, only a later one).

The rule (docs/design.md, "Folders"): no import cycle; the core imports no wing (`jax/`,
`torch/`); the torch wing imports nothing of the JAX wing; `format/` and `planning/` import
no framework and nothing above them. A subprocess checks the last at runtime too: torch
state saved and loaded without one module of `snapshard.jax` being imported."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import snapshard

ROOT = pathlib.Path(snapshard.__file__).parent

WINGS = ("snapshard.jax", "snapshard.torch")
# The integrations and the faces may use a wing; everything else is the core.
OUTSIDE_CORE = (
    *WINGS,
    "snapshard.lightning",
    "snapshard.accelerate",
    "snapshard.torchtitan",
    "snapshard.orbax",
    "snapshard.cli",
    "snapshard.safetensors",
    "snapshard.__main__",
)
# What `format/` and `planning/` may import besides themselves: the package's foundations.
FOUNDATIONS = (
    "snapshard.errors",
    "snapshard.dtypes",
    "snapshard.checksum",
    "snapshard.cpus",
    "snapshard.gc_pause",
    "snapshard.tree",
    "snapshard.storage",
)
FRAMEWORKS = ("jax", "jaxlib", "torch", "orbax", "tensorstore", "flax", "safetensors")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _named(name: str, path: pathlib.Path, mods: set[str]) -> set[str]:
    """Every module named by an import statement anywhere in the module (third-party ones
    as written, the package's resolved to the module or package imported)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            named.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                up = package.split(".")
                base = ".".join(up[: len(up) - n.level + 1] + ([n.module] if n.module else []))
            subs = {f"{base}.{a.name}" for a in n.names} & mods
            named.update(subs or {base})
    return named


def _imports(name: str, path: pathlib.Path, mods: set[str]) -> set[str]:
    """The package's modules that `name` imports, itself left out."""
    out = set()
    for d in _named(name, path, mods):
        while d and d not in mods:
            d = d.rpartition(".")[0]
        if d and d != name:
            out.add(d)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _core(module: str) -> bool:
    return module != "snapshard" and not _under(module, OUTSIDE_CORE)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (depth-first, colouring the modules)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                path = [m for m, _ in stack]
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
    return None


def test_every_import_is_read():
    """In-function and TYPE_CHECKING imports count: the reader sees both kinds."""
    graph = _graph()
    assert "snapshard.format.refs" in graph["snapshard.format.manifest"]  # module level
    assert "snapshard.storage" in graph["snapshard.format.encoding"]  # under TYPE_CHECKING
    assert "snapshard.storage.objstore" in graph["snapshard.storage"]  # inside a function


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_core_imports_no_wing():
    found = {(m, d) for m, deps in _graph().items() if _core(m) for d in deps if _under(d, WINGS)}
    assert sorted(found) == []


def test_the_torch_wing_imports_nothing_of_the_jax_wing():
    found = sorted(
        (m, d)
        for m, deps in _graph().items()
        if _under(m, ("snapshard.torch",))
        for d in deps
        if _under(d, ("snapshard.jax",))
    )
    assert found == []


# What each may import of the package besides itself: `planning/` is pure (layouts and
# integers); `format/` sits on it and on the foundations.
BELOW = {
    "snapshard.planning": (),
    "snapshard.format": ("snapshard.planning", *FOUNDATIONS),
}


@pytest.mark.parametrize("package", sorted(BELOW))
def test_format_and_planning_import_no_framework_and_nothing_above_them(package):
    mods = _modules()
    names = set(mods)
    for m, p in mods.items():
        if not _under(m, (package,)):
            continue
        frameworks = sorted(d for d in _named(m, p, names) if d.split(".")[0] in FRAMEWORKS)
        assert frameworks == [], f"{m} imports {frameworks}"
        above = sorted(
            d for d in _imports(m, p, names) if not _under(d, (package, *BELOW[package]))
        )
        assert above == [], f"{m} imports {above}"


def test_the_rules_catch_what_they_forbid():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    assert _core("snapshard.reading.requests") and _core("snapshard.manager.manager")
    assert not _core("snapshard.jax.load") and not _core("snapshard.torch.loading")
    assert _under("snapshard.jax.arrays", WINGS) and not _under("snapshard.jaxlike", WINGS)


_TORCH_ONLY = textwrap.dedent(
    """
    import sys, tempfile
    import torch
    import snapshard.torch as sst
    d = tempfile.mkdtemp()
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}
    sst.save(d + "/c", state)
    into = {"w": torch.zeros(3, 4), "step": 0}
    got = sst.load(d + "/c", into)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3, got
    print(sorted(m for m in sys.modules if m == "snapshard.jax" or m.startswith("snapshard.jax.")))
    """
)


def test_torch_save_and_load_import_no_module_of_the_jax_wing(tmp_path):
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    done = subprocess.run(
        [sys.executable, "-c", _TORCH_ONLY],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
