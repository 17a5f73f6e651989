"""Copies of one part of an array held by several processes, checked to hold one value.

A save writes each part (box) of an array once, whichever of its holders writes it, on the
word of the framework that the holders' copies are equal. Where the word is wrong, one copy
is kept and the others are dropped without a sign: a torch DTensor on a sub-mesh (one
pipeline stage's data-parallel mesh) is taken to be replicated along the root mesh's other
dimensions, so stages whose state uses the same names (every stage's first layer called
`0.weight`) would be saved as one stage, mixed.

The protocol, kept out of the way of the save:

1. Blocking phase, every process: for each array leaf held in copies (`copy_leaves`: a
   layout with a box held by two or more processes, not a value the process holds whole,
   whose digest the commit compares already) the framework's source gives a fingerprint
   of this process's copy (`ReplicatedSource.copy_digests`: a crc32c of sampled elements,
   taken before the training step can change them; parts of at most 64 KiB whole). It
   goes in the leaf's value digest,
   which the record file keeps (docs/format.md).
2. Report: the tree's digest leaves these out (processes holding other parts differ there
   by design); `copies_digest` sums them up in one number.
3. Commit, process 0 (`check_copies`): processes holding the same parts of every such leaf
   (`holder_signatures`, from the layouts alone: no process is asked) must report the same
   number. Where two do not, their two record files say which leaf differs.

A fingerprint of samples catches copies that are different tensors (another stage's or
expert's weights), not one element out of step.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..checksum import crc32c
from ..errors import CoordinationError, SnapshardError
from ..format import record_file_name, records
from ..format.files import ProcessReport
from ..format.leaves import Leaf
from ..planning.layout import ArrayLayout
from .save_array import SaveArray
from .state import PreparedSave, ReplicatedSource

SAMPLES = 64  # elements sampled from each larger copy, evenly spaced, the first and last among them
WHOLE_BYTES = 1 << 16  # copies of at most this many bytes are fingerprinted whole


def held_in_copies(layout: ArrayLayout) -> bool:
    """Whether a box of `layout` is held by two or more processes (kept in its memo)."""
    memo = layout.memo
    if memo.copies is None:
        groups = layout.shards
        memo.copies = not memo.own and bool(groups.count) and int(groups.num_candidates.max()) > 1
    return memo.copies


def copy_leaves(leaves: list[Leaf | SaveArray]) -> np.ndarray:
    """Indices of the leaves whose copies are fingerprinted: arrays held in copies whose
    source is a framework's (ReplicatedSource) part of a sharded array."""
    found = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, SaveArray)
        and isinstance(leaf.source, ReplicatedSource)
        and leaf.source.sharded
        and held_in_copies(leaf.layout)
    ]
    return np.asarray(found, np.int64)


def put_fingerprints(leaves: list[Leaf | SaveArray], digests: np.ndarray, at: np.ndarray) -> None:
    """Each copy leaf's fingerprint (`at`: copy_leaves) in its value digest, asked of its
    sources a class at a time."""
    by_class: dict[type[ReplicatedSource], tuple[list[int], list[ReplicatedSource]]] = {}
    for i in at.tolist():
        source = leaves[i].source
        found, sources = by_class.setdefault(type(source), ([], []))
        found.append(i)
        sources.append(source)
    for cls, (found, sources) in by_class.items():
        digests["value"][found] = cls.copy_digests(sources)


@functools.lru_cache(maxsize=256)
def sampled_at(shape: tuple[int, ...], itemsize: int) -> np.ndarray | None:
    """Which elements of a part of `shape` its fingerprint covers, as flat C-order indices
    (SAMPLES of them, evenly spaced from the first to the last); None: all of its bytes, for
    a part of at most WHOLE_BYTES, whose crc32c costs less than picking samples."""
    n = math.prod(shape)
    if n * itemsize <= WHOLE_BYTES:
        return None
    return np.arange(SAMPLES, dtype=np.int64) * (n - 1) // (SAMPLES - 1)


def tree_digest(digests: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The digests that every process must report alike: the copies' fingerprints zeroed."""
    if not len(at):
        return digests
    out = digests.copy()
    out["value"][at] = 0
    return out


def copies_digest(digests: np.ndarray, at: np.ndarray) -> int:
    """One number for this process's copies (0 where it holds none)."""
    if not len(at):
        return 0
    return crc32c(np.ascontiguousarray(digests["value"][at]).tobytes())


def holder_signatures(leaves: list[Leaf | SaveArray], at: np.ndarray, processes: int) -> np.ndarray:
    """Per process, a number that is equal for two processes exactly when they hold the same
    boxes of every copy leaf (up to hash collisions): from the layouts, each distinct one once."""
    sig = np.zeros(processes, np.uint64)
    seen: set[int] = set()
    with np.errstate(over="ignore"):
        for i in at.tolist():
            layout = leaves[i].layout
            if id(layout) in seen:
                continue
            seen.add(id(layout))
            groups = layout.shards
            held = np.zeros(processes, np.uint64)
            box = groups.cand_box.astype(np.uint64) + np.uint64(1)
            np.add.at(held, groups.cand_process, box * np.uint64(0x9E3779B97F4A7C15))
            sig = sig * np.uint64(1_000_003) + held
    return sig


def check_copies(prep: PreparedSave, reports: list[ProcessReport], at: np.ndarray) -> None:
    """Process 0: processes holding the same parts report the same copies (see the module's
    doc); raises naming the leaf and two processes where they do not."""
    if not len(at):
        return
    sig = holder_signatures(prep.leaves, at, len(reports))
    first: dict[int, int] = {}
    for q, r in enumerate(reports):
        p = first.setdefault(int(sig[q]), q)
        if reports[p].copies != r.copies:
            raise _differing(prep, at, reports, p, q)


def _differing(
    prep: PreparedSave, at: np.ndarray, reports: list[ProcessReport], p: int, q: int
) -> CoordinationError:
    """The error for processes p and q, naming the leaves where their record files differ."""
    where = "which leaf, their record files cannot tell: they cannot be read back"
    try:
        mine, theirs = (
            records.staged_digests(prep.storage.read_staging(record_file_name(x, reports[x].nonce)))
            for x in (p, q)
        )
    except (SnapshardError, OSError):
        mine = theirs = None
    if mine is not None and theirs is not None and len(mine) == len(theirs) == len(prep.leaves):
        differ = at[mine["value"][at] != theirs["value"][at]]
        if len(differ):
            names = ", ".join(repr(prep.leaves[int(i)].name) for i in differ[:3])
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            where = f"{'leaf' if len(differ) == 1 else 'leaves'} {names}{more}"
    return CoordinationError(
        f"{prep.rendezvous.what}: processes {p} and {q} hold copies of the same part of an "
        f"array, saved once for both, with different values ({where}). A tensor on a sub-mesh "
        "is taken to be copied along the mesh's other dimensions: state that differs by rank "
        "under the same names (pipeline stages or expert groups with keys of their own, such "
        "as '0.weight' on every stage) would be saved mixed. Give each stage's tensors names "
        "of their own (the whole model's parameter names) and save with "
        "SaveOptions(trees_differ=True)"
    )
