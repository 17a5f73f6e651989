"""The manifest's `layouts` and `meshes` lists as a save builds them: every writer of a
manifest (the save executor, the union of differing trees, DCP's storage writer, the
converter's box writer) lists each distinct description once and refers to it by its index.
Pure: no I/O here."""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from typing import Any


class LayoutTable:
    """Distinct layout and mesh descriptions (format.layouts), in the order first met."""

    def __init__(self) -> None:
        self.layouts: list[dict[str, Any]] = []
        self.meshes: list[dict[str, Any]] = []
        self._layout_ids: dict[str, int] = {}
        self._mesh_ids: dict[Hashable, int] = {}

    def mesh(self, key: Hashable, make: Callable[[], dict[str, Any]]) -> int:
        """The index of the mesh `key` names, `make()` listed the first time."""
        found = self._mesh_ids.get(key)
        if found is None:
            found = self._mesh_ids[key] = len(self.meshes)
            self.meshes.append(make())
        return found

    def layout(self, doc: dict[str, Any]) -> int:
        """The index of layout description `doc` (a mesh layout names its mesh's index)."""
        key = json.dumps(doc, sort_keys=True)
        found = self._layout_ids.get(key)
        if found is None:
            found = self._layout_ids[key] = len(self.layouts)
            self.layouts.append(doc)
        return found
