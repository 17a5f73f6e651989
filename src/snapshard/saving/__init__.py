"""The save executor: plan, stage the owned slices on the host, write, then commit; one for
both wings, which reach it through their `SaveAdapter`.

Blocking phase (the caller waits; `blocking.py`): flatten the tree, classify its leaves
(`save_array.py`), plan (cached, zero-RPC), bring every owned slice to host memory through
the adapter (`staging.py`). Nothing else.

Background phase, in threads or in a writer process (`writer_*.py`): every process writes
its own data files (`chunk_files.py`; incremental saves' references, `incremental.py`),
record file and report with no coordination (`files.py`); process 0 gathers the reports,
checks that the trees fit together (`agreement.py`, `tree_union.py`), builds the manifest
from the leaves' descriptions (`leaves.py`), validates it, removes stale files and commits; every process learns the outcome (`commit.py`).
Synchronisation points per save: one rendezvous after writing (process 0 waits for every
process's report) and one outcome broadcast. `state.py` holds what a save carries from one
phase to the next; `entry.py` the entry points. See docs/design.md.
"""

from .blocking import prepare, refuse_existing
from .commit import commit_manifest, staged_files
from .entry import AsyncSave, finish, save, save_async, save_through
from .files import ChunkColumns, write_chunk_files
from .leaves import classify_leaves, leaf_digests, path_json
from .state import ReplicatedSource, SaveAdapter, SaveTimings

__all__ = [
    "AsyncSave",
    "ChunkColumns",
    "ReplicatedSource",
    "SaveAdapter",
    "SaveTimings",
    "classify_leaves",
    "commit_manifest",
    "finish",
    "leaf_digests",
    "path_json",
    "prepare",
    "refuse_existing",
    "save",
    "save_async",
    "save_through",
    "staged_files",
    "write_chunk_files",
]
