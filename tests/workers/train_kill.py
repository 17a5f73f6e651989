"""Run the demo's training loop, optionally SIGKILLing this process at a point of a save.

usage: train_kill.py DIR STEPS EVERY [KILL_POINT SAVE_NUMBER]
   KILL_POINT: 'stage' (during the host copy), 'write' (while writing data files),
   'commit' (just before the commit), 'writer' (when the save's writer process, its files
   written, asks this process for its first coordination call: this process dies, its
   writer lives on; the writer's process id is printed first, as 'WRITER <pid>');
   SAVE_NUMBER counts the saves of this run from 1.
Prints 'RESULT {"digest": ...}' when the run ends.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

from _dist import report


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill(point: str, at: int) -> None:
    from snapshard.storage import local, local_files

    save_mod = importlib.import_module("snapshard.jax.save_adapter")  # JaxAdapter.stage calls it

    calls = {"n": 0}
    real_stage = save_mod.stage
    real_write, real_commit = local_files.LocalFileWriter.write, local.LocalStorage.commit

    def stage(*a, **k):
        calls["n"] += 1
        if point == "stage" and calls["n"] == at:
            die()
        return real_stage(*a, **k)

    def write(self, data):
        if point == "write" and calls["n"] == at:
            real_write(self, data[: len(data) // 2])  # small files come in one write: tear it
            die()  # after the first bytes of a data file are out
        return real_write(self, data)

    def commit(self, manifest, *, overwrite):
        if point == "commit" and calls["n"] == at:
            die()
        return real_commit(self, manifest, overwrite=overwrite)

    save_mod.stage = stage
    local_files.LocalFileWriter.write = write
    local.LocalStorage.commit = commit
    if point == "writer":
        from snapshard.saving import writer_process

        real_answer = writer_process.WriterProcess._answer

        def answer(self, *a, **k):
            if calls["n"] == at:
                print(f"WRITER {self.proc.pid}")
                die()
            return real_answer(self, *a, **k)

        writer_process.WriterProcess._answer = answer


def load_example(name: str) -> Any:
    """examples/<name>.py as a module."""
    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    directory, steps, every = sys.argv[1], sys.argv[2], sys.argv[3]
    if len(sys.argv) > 4:
        install_kill(sys.argv[4], int(sys.argv[5]))
    demo = load_example("demo")
    digest = demo.main(["--dir", directory, "--steps", steps, "--every", every, "--keep", "2"])
    report(digest=digest)


if __name__ == "__main__":
    main()
