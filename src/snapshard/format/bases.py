"""Format v2 references, checked against the checkpoints they name: each referenced
checkpoint is committed beside the one read (never through a symbolic link), its manifest is
intact, lists the referenced file at the referenced size, and (2.1) binds its checksums to
its files as the referring checkpoint expects (format.binding).

Only the referenced checkpoints' manifests are read (a step retained for references keeps
its manifest and the referenced data files; see design.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from .manifest import Manifest

if TYPE_CHECKING:
    from ..storage import Storage


def check_bases(storage: Storage, m: Manifest) -> None:
    """Every checkpoint `m`'s refs name is committed and vouches for the referenced files."""
    wanted: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for k, r in enumerate(m.refs):
        if isinstance(r, dict):  # (format.refs checked the entries' types and names)
            wanted.setdefault(r["checkpoint"], []).append((k, r))
    for name, refs in sorted(wanted.items()):
        base = _base_manifest(storage, name)
        assert base.processes is not None  # a v2 manifest
        sizes = {f.name: f.size for f in base.processes.files(bound=False)}
        for k, r in refs:
            if sizes.get(r["file"]) != r["size"]:
                listed = sizes.get(r["file"])
                what = "lists no such file" if listed is None else f"gives it {listed} bytes"
                raise CorruptCheckpointError(
                    f"{storage.url}: reference {k} names {r['file']!r} of {r['size']} bytes in "
                    f"checkpoint {name!r}, whose manifest {what}"
                )
        if m.bound and not base.bound:
            raise CorruptCheckpointError(
                f"{storage.url}: references name checkpoint {name!r} of format "
                f"{base.version_text}, whose checksums are not bound to its files"
            )


def _base_manifest(storage: Storage, name: str) -> Manifest:
    sibling = storage.sibling(name)
    try:
        raw = sibling.read_manifest()
        base = Manifest.from_json(raw, sibling.url)
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(
            f"{storage.url}: references name checkpoint {name!r}, which is not committed ({e})"
        ) from None
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(
            f"{storage.url}: references name checkpoint {name!r}, which is damaged: {e}"
        ) from None
    finally:
        sibling.close()
    if base.version < 2 or base.processes is None:
        raise CorruptCheckpointError(
            f"{storage.url}: references name checkpoint {name!r} of format {base.version_text}"
        )
    return base
