"""Names a package exports but imports on first use (PEP 562 module `__getattr__`), so
importing the package stays cheap and loads no framework until a name that needs one is
looked up."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from typing import Any


def lazy_getattr(
    package: str, names: Mapping[str, str], modules: Collection[str] = ()
) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `names` maps each exported name to the
    submodule (relative to `package`) that defines it; `modules` names submodules that are
    themselves exported (`package.dcp`). What is found is cached in the package's namespace,
    so each name is imported once."""

    def __getattr__(name: str) -> Any:
        if name in modules:
            return importlib.import_module(f".{name}", package)  # (the import binds it)
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    return __getattr__
