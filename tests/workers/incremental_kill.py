"""Incremental managed saves (max_to_keep=2), SIGKILLing this process at a point.

usage: incremental_kill.py DIR POINT AT [FIRST LAST]
   POINT: 'write' (while writing the data files of save number AT), 'commit' (just before
   the commit of save AT), 'retention' (after the AT-th file or step removal of retention),
   'none'. Steps FIRST..LAST (default 1..5) save test_incremental.tree(step).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    directory, point, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    first, last = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (1, 5)
    import snapshard
    from snapshard.manager import references
    from snapshard.storage import local, local_files
    from test_incremental import tree

    saves = {"n": 0, "removals": 0}
    real_write, real_commit = local_files.LocalFileWriter.write, local.LocalStorage.commit
    real_delete_files, real_delete = references._delete_files, local.LocalStorage.delete

    def write(self, data):
        if point == "write" and saves["n"] == at:
            real_write(self, data[: len(data) // 2])  # small chunks come in one write: tear it
            die()
        return real_write(self, data)

    def commit(self, manifest, *, overwrite):
        if point == "commit" and saves["n"] == at:
            die()
        return real_commit(self, manifest, overwrite=overwrite)

    def removal(real):
        def run(*a, **k):
            out = real(*a, **k)
            saves["removals"] += 1
            if point == "retention" and saves["removals"] == at:
                die()
            return out

        return run

    local_files.LocalFileWriter.write = write
    local.LocalStorage.commit = commit
    references._delete_files = removal(real_delete_files)
    local.LocalStorage.delete = removal(real_delete)
    # In threads: the kill points above are patched into this process (the writer
    # process's own kills are tests/test_writer_process.py's).
    threads = snapshard.SaveOptions(background="thread")
    with snapshard.CheckpointManager(
        directory, max_to_keep=2, incremental=True, save_options=threads
    ) as m:
        for step in range(first, last + 1):
            saves["n"] += 1
            m.save(step, tree(step))
            m.wait_until_finished()
    print("done")


if __name__ == "__main__":
    main()
