"""Workers of the multi-process tests (run by tests/multiproc.py).

With SNAPSHARD_TEST_WITHOUT_JAX=1 in its environment a worker cannot import JAX, as in an
install with PyTorch alone: snapshard.torch must never need it.
"""

from __future__ import annotations

import os
import sys
from typing import Any


class _NoJax:
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in ("jax", "jaxlib"):
            raise ImportError(f"{name} is not installed here (SNAPSHARD_TEST_WITHOUT_JAX)")


if os.environ.get("SNAPSHARD_TEST_WITHOUT_JAX") == "1":
    assert "jax" not in sys.modules, "JAX was imported before the worker started"
    sys.meta_path.insert(0, _NoJax())
