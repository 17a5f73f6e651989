"""Multi-process worker: a save during which one process is SIGKILLed, or clean saves.

usage: dies_mid_save.py DIR VICTIM TIMEOUT_S
   VICTIM: the process that dies (process 0 just before its commit, another one while
   writing), or -1: three saves that succeed, then report the coordination keys left.
The survivors report the error they got, its type and the seconds it took.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from _dist import init, report

from snapshard import SaveOptions


def main() -> None:
    directory, victim, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    pid, n = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    from snapshard.coordination import default_coordinator
    from snapshard.storage import local, local_files

    mesh = Mesh(np.array(jax.devices()).reshape(n, -1), ("data", "model"))
    w = jax.device_put(
        np.arange(64 * 16, dtype=np.float32).reshape(64, 16), NamedSharding(mesh, P("data"))
    )
    if victim < 0:
        for i in range(3):
            snapshard.save(f"{directory}/{i}", {"w": w}, options=SaveOptions(timeout_s=timeout_s))
        coord = default_coordinator()
        coord.barrier("snapshard-test/saved", 30)
        time.sleep(0.5)  # the last reader of each outcome deletes the save's keys
        left = coord.get_dir("snapshard/save")
        coord.barrier("snapshard-test/listed", 30)
        report(ok=True, left=sorted(left), pid=pid)
        return
    if pid == victim:
        real_commit, real_write = local.LocalStorage.commit, local_files.LocalFileWriter.write

        def die(*a, **k):
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        if victim == 0:
            local.LocalStorage.commit = die
        else:
            local_files.LocalFileWriter.write = die
        del real_commit, real_write
    t0 = time.monotonic()
    try:
        snapshard.save(directory, {"w": w}, options=SaveOptions(timeout_s=timeout_s))
        report(ok=True, pid=pid)
    except Exception as e:
        report(
            ok=False,
            error_type=type(e).__name__,
            error=str(e),
            seconds=time.monotonic() - t0,
            pid=pid,
        )


if __name__ == "__main__":
    main()
