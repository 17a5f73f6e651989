"""Copies of one part of an array held by several processes, checked to hold one tensor.

A save writes each part (box) of an array once, whichever of its holders writes it, on the
word of the framework that the holders' copies are equal. Where the word is wrong, one copy
is kept and the others are dropped without a sign: a torch DTensor on a sub-mesh (one
pipeline stage's data-parallel mesh) is taken to be replicated along the root mesh's other
dimensions, so stages whose state uses the same names (every stage's first layer called
`0.weight`) would be saved as one stage, mixed.

Copies may also differ a little where nothing is wrong: a replicated parameter that each
tensor-parallel rank updates itself, with kernels that do not add in one order (atomics on
a GPU), drifts in its last bits. One of such copies is what DCP saves too, and what the
training would go on with; refusing the save would stop a healthy run. So the check asks
whether the copies are the same tensor, not the same bits: the fingerprint of a copy is
the signs of SAMPLES elements, evenly spaced from the first to the last (bit k set where
element k is above 0), which drift leaves alone but for elements within the drift of 0,
and two different tensors (another stage's weights) disagree in about half of.

The protocol, kept out of the way of the save:

1. Blocking phase, every process: for each array leaf whose copies are the save's own
   assumption (`copy_leaves`: a DTensor on a sub-mesh; a Replicate placement is the
   framework's word, as DCP takes it, and a value every process holds whole has its digest
   compared already) the framework's source gives the fingerprint
   of this process's copy (`ReplicatedSource.copy_digests`, taken before the training step
   can change it). It goes in the leaf's value digest, which the record file keeps
   (docs/format.md).
2. Report: the tree's digest leaves these out (processes holding other parts differ there
   by design); `copies_digest` sums them up in one number.
3. Commit, process 0 (`check_copies`): processes holding the same parts of every such leaf
   (`holder_signatures`, from the layouts alone: no process is asked) should report the
   same number. Where two do not, their two record files say which leaves differ and by how
   many signs: FAR or more in a leaf refuses the save, naming the leaves; fewer is drift.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from ..checksum import crc32c
from ..errors import CoordinationError, SnapshardError
from ..format import record_file_name, records
from ..format.files import ProcessReport
from ..format.leaves import Leaf
from .save_array import SaveArray
from .state import PreparedSave, ReplicatedSource

log = logging.getLogger("snapshard")

SAMPLES = 32  # elements whose signs fingerprint a copy (the bits of a value digest)
# Signs in which two copies of one tensor differ only by mistake (a part of fewer elements
# is never refused on its own: a stage's weights are refused with it).
FAR = SAMPLES // 4
_CHECKED = 32  # record files one commit reads at most to compare copies


def copy_leaves(leaves: list[Leaf | SaveArray]) -> np.ndarray:
    """Indices of the leaves whose copies are fingerprinted: arrays held in copies that are
    the save's own assumption (ReplicatedSource.copies_assumed: a sub-mesh widened to its
    copies, two or more, so every box has two holders or more), not the framework's word
    (a Replicate placement)."""
    found = [
        i
        for i, leaf in enumerate(leaves)
        if isinstance(leaf, SaveArray)
        and isinstance(leaf.source, ReplicatedSource)
        and leaf.source.copies_assumed
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


@functools.lru_cache(maxsize=1024)
def sample_indices(n: int) -> np.ndarray:
    """The flat C-order indices of the elements of a part of `n` whose signs fingerprint it:
    SAMPLES of them evenly spaced from the first to the last (every one where n <= SAMPLES)."""
    if n <= SAMPLES:
        return np.arange(n, dtype=np.int64)
    return np.arange(SAMPLES, dtype=np.int64) * (n - 1) // (SAMPLES - 1)


def signs(values: np.ndarray) -> int:
    """The fingerprint of sampled elements (sample_indices): bit k set where element k is
    above 0 (the real part of a complex one; NaN is not)."""
    v = values.real if values.dtype.kind == "c" else values
    return int.from_bytes(np.packbits(np.asarray(v > 0).reshape(-1), bitorder="little"), "little")


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
            held = np.zeros(processes, np.uint64)  # (a set of boxes: a sum of their hashes)
            np.add.at(held, groups.cand_process, _mix(groups.cand_box.astype(np.uint64) + 1))
            sig = _mix(sig ^ held)
    return sig


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: 64-bit numbers scattered, so that sums of them collide only
    by chance."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def check_copies(prep: PreparedSave, reports: list[ProcessReport], at: np.ndarray) -> None:
    """Process 0: processes holding the same parts hold the same tensors (see the module's
    doc); raises naming the leaves and two processes where they do not."""
    if not len(at):
        return
    sig = holder_signatures(prep.leaves, at, len(reports))
    first: dict[int, int] = {}
    read: dict[int, np.ndarray | None] = {}
    drifted: list[int] = []
    for q, r in enumerate(reports):
        p = first.setdefault(int(sig[q]), q)
        if reports[p].copies == r.copies:
            continue
        if len(read) >= _CHECKED:
            log.warning(
                "%s: %d more processes hold copies that differ from others' a little or more: "
                "not compared", prep.rendezvous.what, len(reports) - q,
            )  # fmt: skip
            break
        for x in (p, q):
            if x not in read:
                read[x] = _prints(prep, reports, x, at)
            if read[x] is None:
                raise CoordinationError(
                    f"{prep.rendezvous.what}: process {x}'s record file cannot be read back"
                )
        apart = _popcount(read[p] ^ read[q])  # type: ignore[operator]
        far = at[apart >= FAR]
        if len(far):
            names = ", ".join(repr(prep.leaves[int(i)].name) for i in far[:3])
            more = f" and {len(far) - 3} more" if len(far) > 3 else ""
            raise _differing(prep, p, q, f"{'leaf' if len(far) == 1 else 'leaves'} {names}{more}")
        drifted.append(q)
    if drifted:
        log.info(
            "%s: copies held by processes %s differ from others' in a few signs (drift, such "
            "as a replicated parameter updated on each rank): one of each is saved",
            prep.rendezvous.what, ", ".join(map(str, drifted[:8])),
        )  # fmt: skip


def _prints(
    prep: PreparedSave, reports: list[ProcessReport], x: int, at: np.ndarray
) -> np.ndarray | None:
    """Process x's fingerprints of the copy leaves, from its record file (None: unreadable)."""
    try:
        raw = prep.storage.read_staging(record_file_name(x, reports[x].nonce))
    except (SnapshardError, OSError):
        return None
    digests = records.staged_digests(raw)
    if digests is None or len(digests) != len(prep.leaves):
        return None
    return np.asarray(digests["value"][at], np.uint32)


def _popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint32 (NumPy before 2.0 has no bitwise_count)."""
    return np.unpackbits(x.astype("<u4").view(np.uint8).reshape(-1, 4), axis=1).sum(axis=1)


def _differing(prep: PreparedSave, p: int, q: int, which: str) -> CoordinationError:
    return CoordinationError(
        f"{prep.rendezvous.what}: processes {p} and {q} hold copies of the same part of an "
        f"array, saved once for both, that are different tensors ({which}: their signs "
        "differ at sampled elements). A tensor on a sub-mesh is taken to be copied along the "
        "mesh's other dimensions: state that differs by rank under the same names (pipeline "
        "stages or expert groups with keys of their own, such as '0.weight' on every stage, "
        "or replicas that train apart) would be saved mixed. Give each stage's tensors names "
        "of their own (the whole model's parameter names) and save with "
        "SaveOptions(trees_differ=True), or make the copies agree before saving"
    )
