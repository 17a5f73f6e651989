"""One process that leaves a staging directory behind: killed in the middle of a save, or
alive and holding one.

usage: stale_writer.py MODE PATH [TOKEN]
  kill-numpy  snapshard.save(PATH, ...) that exits (os._exit) at its first data write
  kill-torch  snapshard.torch.save(PATH, ...), the same
  kill-dcp    dcp.save(..., storage_writer=snapshard.torch.StorageWriter(PATH)), the same
  hold        stage for PATH under attempt TOKEN as a writer of a save would, print READY,
              then wait until stdin closes (a live writer, or one of a job's processes)
Exits 3 when killed mid-save as asked; 0 after `hold`.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from snapshard.storage import local, local_files


def _die_at_first_write() -> None:
    def write(self: local_files.LocalFileWriter, data: memoryview) -> None:
        os._exit(3)

    local_files.LocalFileWriter.write = write  # type: ignore[method-assign]
    local_files.LocalFileWriter.write_parts = write  # type: ignore[method-assign, assignment]


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "hold":
        storage = local.LocalStorage(path)
        storage.set_attempt(sys.argv[3])
        storage.prepare_staging()
        (storage.staging / "data" / "p00000-held-0.bin").write_bytes(b"x" * 4096)
        print("READY", flush=True)
        sys.stdin.read()
        return
    _die_at_first_write()
    state = {"w": np.arange(1 << 16, dtype=np.float32)}
    if mode == "kill-numpy":
        import snapshard

        snapshard.save(path, state)
    else:
        import torch

        tensors = {"w": torch.from_numpy(state["w"])}
        if mode == "kill-torch":
            import snapshard.torch as sst

            sst.save(path, tensors)
        elif mode == "kill-dcp":
            import torch.distributed.checkpoint as dcp

            import snapshard.torch as sst

            dcp.save(tensors, storage_writer=sst.StorageWriter(path))
    sys.exit(f"{mode}: the save finished, it was to be killed")


if __name__ == "__main__":
    main()
