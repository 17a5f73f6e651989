"""Multi-process worker: asynchronous saves whose background phase runs in writer processes
(SaveOptions(background="process")), one of whose writers may be SIGKILLed mid-save.

usage: writer_process_save.py DIR VICTIM WHEN
   VICTIM: the process whose writer is killed in the first save, or -1: none is. WHEN:
   'report', as the writer reports its files written (the save then fails everywhere), or
   'outcome', as it waits for process 0's outcome after reporting (the save commits).
   Either way a second save follows, which must succeed and load back equal.
Each process reports the first save's outcome, the second's, and its writers' process ids.
"""

from __future__ import annotations

import os
import signal
import sys

from _dist import init, report

from snapshard import SaveOptions


def main() -> None:
    directory, victim, when = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    pid, n = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    import snapshard.jax  # the wing's coordinator is the job's
    from snapshard.coordination import default_coordinator
    from snapshard.saving import writer_process

    mesh = Mesh(np.array(jax.devices()).reshape(n, -1), ("data", "model"))
    host = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    w = jax.device_put(host, NamedSharding(mesh, P("data")))
    tree = {"w": w, "step": 7, "b": np.arange(5)}
    options = SaveOptions(background="process", timeout_s=30)
    writers = []
    coord = default_coordinator()
    assert coord.process_count == n
    killed: list[int] = []

    def kill_the_writer() -> None:
        assert writer_process._writer is not None
        killed.append(writer_process._writer.proc.pid)
        os.kill(killed[0], signal.SIGKILL)
        writer_process._writer.proc.wait()
        raise OSError("the writer was killed")  # its call never returns to it

    if pid == victim:
        real_set, real_get = coord.set, coord.get

        def set_then_die(key: str, value: str) -> None:
            if when == "report" and "/written/" in key and not killed:
                kill_the_writer()
            real_set(key, value)

        def get_then_die(key: str, timeout_s: float) -> str:
            if when == "outcome" and key.endswith("/outcome") and not killed:
                kill_the_writer()
            return real_get(key, timeout_s)

        coord.set, coord.get = set_then_die, get_then_die  # type: ignore[method-assign]
    first: dict[str, object] = {"ok": True}
    try:
        snapshard.save_async(f"{directory}/0", tree, options).wait()
    except Exception as e:
        first = {"ok": False, "error_type": type(e).__name__, "error": str(e)}
    if pid == victim:
        assert killed, "the writer was not killed"
        coord.set, coord.get = real_set, real_get  # type: ignore[method-assign]
    writers.append(killed[0] if killed else writer_process._writer.proc.pid)  # type: ignore[union-attr]
    snapshard.save_async(f"{directory}/1", tree, options).wait()
    writers.append(writer_process._writer.proc.pid if writer_process._writer else None)
    out = snapshard.load(f"{directory}/1")
    report(
        first=first,
        second_equal=bool(np.array_equal(out["w"], host)) and out["step"] == 7,
        writers=writers,
        me=os.getpid(),
        listing=sorted(os.listdir(directory)),
    )


if __name__ == "__main__":
    main()
