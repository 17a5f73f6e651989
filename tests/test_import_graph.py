"""The package's module-level imports form no cycle (imports inside functions and under
TYPE_CHECKING are left out: they run after every module has loaded)."""

from __future__ import annotations

import ast
import pathlib

import snapshard

ROOT = pathlib.Path(snapshard.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _top_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for n in body:
        if isinstance(n, ast.Import | ast.ImportFrom):
            found.append(n)
        elif isinstance(n, ast.If) and "TYPE_CHECKING" not in ast.unparse(n.test):
            found += _top_level(n.body) + _top_level(n.orelse)
        elif isinstance(n, ast.Try):
            found += _top_level(n.body) + [i for h in n.handlers for i in _top_level(h.body)]
    return found


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    named: set[str] = set()
    for n in _top_level(ast.parse(path.read_text()).body):
        if isinstance(n, ast.Import):
            named.update(a.name for a in n.names)
            continue
        base = n.module or ""
        if n.level:
            up = package.split(".")
            base = ".".join(up[: len(up) - n.level + 1] + ([n.module] if n.module else []))
        subs = {f"{base}.{a.name}" for a in n.names} & mods.keys()
        named.update(subs or {base})
    out = set()
    for d in named:
        while d and d not in mods:
            d = d.rpartition(".")[0]
        if d and d != name:
            out.add(d)
    return out


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
                stack.append((nxt, iter(sorted(graph[nxt]))))
    return None


def test_no_module_level_import_cycle():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert graph["snapshard.format.manifest"] >= {"snapshard.format.refs"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
