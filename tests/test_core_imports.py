"""The framework-neutral core imports no framework: the save executor, the read executor,
the chunk encoding and the coordination package load neither JAX nor torch until a value of
one is met."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE = [
    "snapshard.saving",
    "snapshard.saving.staging",
    "snapshard.background",
    "snapshard.format.encoding",
    "snapshard.format.compressed_reads",
    "snapshard.format.compression",
    "snapshard.format.records",
    "snapshard.jax.save_adapter",
    "snapshard.coordination",
    "snapshard.coordination.rendezvous",
    "snapshard.jax.ppermute",
    "snapshard.coordination.peer_memory",
    "snapshard.coordination.preemption",
    "snapshard.safetensors.export",
    "snapshard.reading",
]


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_no_framework(module):
    code = (
        f"import sys, importlib; importlib.import_module({module!r})\n"
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_save_executor_names_no_jax_module():
    """saving/ reaches JAX only through its adapter (jax/save_adapter.py)."""
    import ast
    from pathlib import Path

    import snapshard.saving

    imported = [
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for path in Path(snapshard.saving.__file__).parent.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [m for m in imported if m == "jax" or m.startswith("jax.") or "jax_arrays" in m]
