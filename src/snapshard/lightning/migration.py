"""Switching a running job: a checkpoint Lightning wrote before the switch (its own `.ckpt`
file, written with torch.save) still loads, through the CheckpointIO and the strategies
(`trainer.fit(model, ckpt_path="last.ckpt")`). It is read with torch.load's `weights_only`
unpickler, as Lightning reads its own files by default: tensors, containers, plain values
and the types Lightning registers as safe, which is all of Lightning's own dict. Anything
beyond that (a custom object in the hyper-parameters or a callback's state) runs code when
unpickled, so it is refused, naming the file, unless `trust_pickle=True` says the file is
the user's own; `weights_only=True` keeps the refusal. The next save to that path (the
`last.ckpt` of `ModelCheckpoint`) replaces the file with a snapshard checkpoint in one
step: the old file stays whole and readable until the new checkpoint commits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..storage.stale_staging import STAGING_SUFFIX
from .pickled import torch_load_dict


def local_file(text: str) -> bool:
    """A file on the local filesystem: what Lightning's own CheckpointIO writes (a snapshard
    checkpoint is a directory, or a prefix on an object store)."""
    return "://" not in text and Path(text).is_file()


def remote_file(text: str) -> bool:
    """An object at `text` that Lightning's own CheckpointIO could have written there (it
    writes URLs through fsspec); asked only where no snapshard checkpoint is."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(text)
        return bool(fs.isfile(root))
    except (ImportError, ValueError, OSError):
        # No fsspec filesystem for the scheme, or no access: the caller's error stands.
        return False


def load_lightning_file(
    path: str, map_location: Any, weights_only: bool | None, trust_pickle: bool, owner: str
) -> dict[str, Any]:
    """A checkpoint Lightning wrote as a file (torch.save), read as Lightning reads it
    (fsspec, torch.load), with torch.load's weights_only unpickler unless `trust_pickle` is
    set (and `weights_only=True` keeps it even then)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(path)
    with fs.open(root, "rb") as f:
        return torch_load_dict(
            f,
            path,
            "this Lightning checkpoint file",
            map_location,
            trust_pickle,
            weights_only,
            f"snapshard.lightning.{owner}",
        )


def save_target(path: str) -> str:
    """Where a save meant for `path` writes: `path`, or, where a checkpoint in Lightning's
    own layout is (written before the switch: a file, or a strategy's directory with its
    `meta.pt`; ModelCheckpoint's `last.ckpt` at the first save after it), a staging name
    beside it, which `move_into_place` then puts in the old one's place in one step."""
    if not lightning_layout(path):
        return path
    final = Path(path)
    return str(final.with_name(final.name + STAGING_SUFFIX + "-lightning"))


def lightning_layout(path: str) -> bool:
    """A checkpoint in Lightning's own layout: a file, or a directory with its meta.pt."""
    local = Path(path)
    return "://" not in path and (local.is_file() or (local / "meta.pt").is_file())
