"""Whether the processes saved trees that fit together, told at the commit: one tree (the
digests of the reports; where one differs, the differing process's record file says which
leaf) or, with SaveOptions.trees_differ, their union (tree_union.py) from one tree file
per distinct tree."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import (
    CoordinationError,
    SnapshardError,
)
from ..format import (
    record_file_name,
    records,
)
from ..format.files import ProcessReport
from ..format.leaves import leaf_from_json
from ..format.naming import tree_file_name
from . import tree_union
from .copies import tree_digest
from .state import PreparedSave


def check_agreement(prep: PreparedSave, reports: list[ProcessReport]) -> None:
    """Every process saved the same tree, with the same host values: where a digest
    differs, the differing process's record file says which leaf."""
    ours = reports[0].digest
    for q, r in enumerate(reports):
        if r.digest != ours:
            raw = prep.storage.read_staging(record_file_name(q, r.nonce))
            raise _disagreement(prep, q, records.staged_digests(raw))


def _disagreement(prep: PreparedSave, q: int, theirs: np.ndarray | None) -> CoordinationError:
    """What differs between process 0's tree and process q's (`theirs`: the digests of q's
    record file, None where it cannot be read), naming the leaves where it can."""
    what, mine = prep.rendezvous.what, prep.digests
    if theirs is None:
        return CoordinationError(f"{what}: process {q}'s record file cannot be read back")
    if len(theirs) == len(mine):
        differ = np.flatnonzero(mine["description"] != theirs["description"])
        if len(differ) == 1:  # one leaf in place: its kind, dtype, shape or layout changed
            return CoordinationError(
                f"{what}: leaf {prep.leaves[int(differ[0])].name!r} differs between process 0 "
                f"and process {q} (kind, dtype, shape or layout)"
            )
        if len(differ) == 0:  # (copies' fingerprints differ where other parts are held)
            at = prep.copies
            values = np.flatnonzero(
                tree_digest(mine, at)["value"] != tree_digest(theirs, at)["value"]
            )
            if len(values):
                return CoordinationError(
                    f"{what}: leaf {prep.leaves[int(values[0])].name!r} has another value on "
                    f"process {q} than on process 0; leaves that are not sharded arrays "
                    "(jax.Array, DTensor) must be the same on every process: wrap values that "
                    "differ by design in snapshard.PerProcess"
                )
            return CoordinationError(
                f"{what}: the tree structure differs between process 0 and process {q}"
            )
    return _other_leaves(prep, q, theirs)


def _other_leaves(prep: PreparedSave, q: int, theirs: np.ndarray) -> CoordinationError:
    """Process q's leaves are not process 0's. A leaf's description digest covers its path,
    kind, dtype, shape and layout: process 0's leaves whose digest q lacks are named, and
    q's leaves that process 0 lacks are placed after the last leaf both have."""
    mine = prep.digests["description"].tolist()
    ours = {d: i for i, d in enumerate(mine)}
    their_set = set(theirs["description"].tolist())
    lacking = [prep.leaves[i].name for i, d in enumerate(mine) if d not in their_set]
    extra: list[str] = []
    extra_at: list[int] = []  # positions in q's leaves: q names them (named_by_us)
    last_common = None
    for j, d in enumerate(theirs["description"].tolist()):
        if d in ours:
            last_common = prep.leaves[ours[d]].name
        else:
            extra.append("first" if last_common is None else f"after {last_common!r}")
            extra_at.append(j)
    if not extra and not lacking and len(theirs) == len(mine):  # one set, in another order
        j = next(j for j, d in enumerate(theirs["description"].tolist()) if d != mine[j])
        theirs_j = prep.leaves[ours[int(theirs["description"][j])]].name
        return CoordinationError(
            f"{prep.rendezvous.what}: process {q} saved the same leaves in another order "
            f"(leaf {j} is {theirs_j!r} there, {prep.leaves[j].name!r} on process 0): every "
            "process gives its tree in one order (a dict built from a set has none)"
        )
    count = lambda n: f"{n} leaf" if n == 1 else f"{n} leaves"  # noqa: E731
    parts = [f"process {q} saved {count(len(theirs))}, process 0 saved {count(len(mine))}"]
    trees_differ = (
        "; for state whose keys differ by rank by design (pipeline stages, expert groups), "
        "save it with SaveOptions(trees_differ=True)"
    )
    if extra:
        parts.append(
            f"process {q} has {len(extra)} that process 0 has not ({', '.join(extra[:3])}"
            + (", ..." if len(extra) > 3 else "")
            + " in its tree)"
        )
    if lacking:
        parts.append(
            ", ".join(repr(n) for n in lacking[:3])
            + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
            + f" of process 0 not on process {q} (or with another kind, dtype, shape or layout)"
        )
    error = CoordinationError(
        f"{prep.rendezvous.what}: the trees differ: " + "; ".join(parts) + trees_differ
    )
    error.relay = {"tree_extra": {"process": q, "leaves": extra_at[:3]}}  # type: ignore[attr-defined]
    return error


def named_by_us(prep: PreparedSave, error: CoordinationError) -> CoordinationError | None:
    """Process 0's tree check found leaves of this process that it has not, and could only
    place them: this process names them."""
    relay = getattr(error, "relay", None)
    extra = relay.get("tree_extra") if isinstance(relay, dict) else None
    if not extra or extra.get("process") != prep.rendezvous.coord.process_index:
        return None
    names = [prep.leaves[i].name for i in extra["leaves"] if 0 <= i < len(prep.leaves)]
    if not names:
        return None
    shown = ", ".join(repr(n) for n in names)
    return type(error)(f"{error}; this process's leaves that process 0 has not: {shown}")


def check_same_save(prep: PreparedSave, reports: list[ProcessReport]) -> None:
    """Every process saved to process 0's location (the saves of a location are paired by
    their number there, or under a manager's directory), with the same
    SaveOptions.trees_differ as process 0."""
    here = reports[0].location
    for q, r in enumerate(reports):
        if r.location != here:
            raise CoordinationError(
                f"{prep.rendezvous.what}: process {q} saved to another location at the same "
                "time (a manager's other step?): every process saves each step, with the "
                "same step number"
            )
        if bool(r.tree) != prep.options.trees_differ:
            raise CoordinationError(
                f"{prep.rendezvous.what}: process {q} saved with SaveOptions(trees_differ="
                f"{bool(r.tree)}), process 0 with trees_differ={prep.options.trees_differ}: every "
                "process passes the same options"
            )


def read_union(prep: PreparedSave, reports: list[ProcessReport]) -> tree_union.Union:
    """Process 0 of a save of differing trees: the union of the processes' trees, from one tree file
    and record file per distinct report digest; every tree file is removed after."""
    storage, what = prep.storage, prep.rendezvous.what
    groups: dict[int, list[int]] = {}
    for q, r in enumerate(reports):
        groups.setdefault(r.digest, []).append(q)

    def read(processes: list[int]) -> tree_union.SavedTree:
        q = processes[0]
        nonce, name = reports[q].nonce, tree_file_name(reports[q].tree)
        try:
            doc = json.loads(storage.read_staging(name))
            digests = records.staged_digests(storage.read_staging(record_file_name(q, nonce)))
        except (SnapshardError, OSError, ValueError) as e:
            raise CoordinationError(f"{what}: process {q}'s tree cannot be read back: {e}") from e
        where = f"{storage.url}/{name}"
        shardings: dict[str, Any] = {}
        leaves = [leaf_from_json(d, where, 2, shardings) for d in doc["leaves"]]
        if digests is None or len(digests) != len(leaves):
            raise CoordinationError(f"{what}: process {q}'s record file does not match its tree")
        return tree_union.SavedTree(
            processes, doc["tree"], leaves, doc["layouts"], doc["meshes"], doc["plans"], digests
        )

    with ThreadPoolExecutor(min(16, len(groups)), "snapshard-trees") as pool:
        trees = list(pool.map(read, groups.values()))
    storage.delete_staging_files(sorted({tree_file_name(r.tree) for r in reports}))
    return tree_union.union(trees, len(reports), what)
