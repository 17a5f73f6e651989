"""A state directory is whole or refused. Accelerate writes its parts one by one into the
directory itself (weights, then optimizers, schedulers, samplers, RNG states, custom
objects), so a `save_state` killed half-way leaves a directory with some of them. Before
snapshard writes the first byte of a save into it, every process puts its marker there,
`snapshard_incomplete_<process index>`; they are taken away once every process's
`save_state` has returned, its part written (`use_snapshard` wraps the accelerator's
`save_state` for that: one barrier per save). A directory with a marker left is refused by
`load_state` before any model or optimizer is touched, with an error naming the newest
complete directory beside it.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointNotFoundError

INCOMPLETE = "snapshard_incomplete_"
_INCOMPLETE = re.compile(rf"^{INCOMPLETE}(\d+)$")
# Accelerate's automatic checkpoint naming (ProjectConfiguration): project_dir/checkpoints/
_AUTOMATIC = re.compile(r"^checkpoint_(\d+)$")

# The directories the running save_state of this process has marked; None outside one (a
# hook registered by hand, without use_snapshard's wrapper, marks nothing: nothing would
# take its marker away).
_marked: set[str] | None = None


def _marker(directory: str, index: int) -> Path:
    return Path(directory) / f"{INCOMPLETE}{index}"


def mark_incomplete(output_dir: str) -> None:
    """Before this process writes the first byte of a save_state into `output_dir`: its
    marker there (once per save)."""
    if _marked is None or output_dir in _marked:
        return
    from accelerate.state import PartialState

    os.makedirs(output_dir, exist_ok=True)
    _marker(output_dir, PartialState().process_index).write_text(
        "save_state of this directory started; this process's part is not all written yet\n"
    )
    _marked.add(output_dir)


def _markers(directory: str) -> list[tuple[int, Path]]:
    """(process index, path) of each marker in `directory`."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [(m, n) for n in names if (m := _INCOMPLETE.match(n))]
    return sorted((int(m.group(1)), Path(directory) / n) for m, n in found)


def wrap_save_state(accelerator: Any) -> None:
    """Make `accelerator.save_state` take the markers away once every process's returned
    (one barrier: then every part is written, and every process, the next to load
    included, finds none); a save_state that raises leaves them. Once per accelerator.
    Every marker there goes, also those of process indices this job does not have (a
    killed save of a larger job): nothing else would remove them."""
    original = accelerator.save_state
    if getattr(original, "_snapshard_wrapped", False):
        return

    @functools.wraps(original)
    def save_state(*args: Any, **kwargs: Any) -> Any:
        global _marked
        _marked = set()
        try:
            result = original(*args, **kwargs)
            if _marked:  # the same on every process: each ran the hook or FSDP functions
                from accelerate.state import PartialState

                PartialState().wait_for_everyone()
                for directory in _marked:
                    for _, path in _markers(directory):
                        path.unlink(missing_ok=True)
            return result
        finally:
            _marked = None

    save_state._snapshard_wrapped = True  # type: ignore[attr-defined]
    accelerator.save_state = save_state


def refuse_incomplete(input_dir: str) -> None:
    """Raise CheckpointNotFoundError if a save_state into `input_dir` did not finish (a
    process's marker is there), before anything is loaded; naming the newest complete
    directory beside it where Accelerate's automatic naming shows one."""
    left = _markers(input_dir)
    if not left:
        return
    indices = ", ".join(str(i) for i, _ in left)
    message = (
        f"{input_dir}: this Accelerate state directory is incomplete: its save_state "
        f"stopped before process(es) {indices} had written their part (their "
        f"{INCOMPLETE}<index> markers are there); nothing was loaded, the models and "
        "optimizers are unchanged"
    )
    earlier = _newest_complete_before(input_dir)
    if earlier is not None:
        message += (
            f". The newest complete one beside it is {earlier}: "
            f"accelerator.load_state({str(earlier)!r}); load_state() without a directory "
            f"picks the newest folder, so remove {input_dir} (Accelerate's save_state "
            "also refuses to save into it again)"
        )
    else:
        message += f". Load another state directory, or save into {input_dir} again"
    raise CheckpointNotFoundError(message)


def _newest_complete_before(input_dir: str) -> Path | None:
    """Of the `checkpoint_<n>` folders beside `input_dir` (Accelerate's automatic naming),
    the newest one older than it without markers; None when it is not one of them."""
    path = Path(os.path.abspath(input_dir))
    own = _AUTOMATIC.match(path.name)
    if own is None:
        return None
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return None
    older = []
    for entry in entries:
        m = _AUTOMATIC.match(entry.name)
        if m and int(m.group(1)) < int(own.group(1)) and entry.is_dir():
            older.append((int(m.group(1)), Path(entry.path)))
    for _, candidate in sorted(older, reverse=True):
        if not _markers(str(candidate)):
            return candidate
    return None
