"""A single-process job that saves many steps through a CheckpointManager.

usage: lease_writer.py ROOT STEPS [LEASE_TIMEOUT_S] [TAKEOVER]
Prints 'STARTED' once the manager holds the root, then 'RESULT {...}': the steps it saved, or
the error that stopped it (its type and text).
"""

from __future__ import annotations

import os
import sys
import time

from _dist import report

from snapshard import ReadOptions, SaveOptions
from snapshard.manager import LeasePolicy, ManagerPolicies


def main() -> None:
    root, steps = sys.argv[1], int(sys.argv[2])
    lease_timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    takeover = len(sys.argv) > 4 and sys.argv[4] == "takeover"
    import numpy as np

    import snapshard

    t0 = time.monotonic()
    try:
        manager = snapshard.CheckpointManager(
            root,
            max_to_keep=3,
            policies=ManagerPolicies(lease=LeasePolicy(lease_timeout, takeover, at_start=True)),
            save_options=SaveOptions(timeout_s=60),
            read_options=ReadOptions(timeout_s=60),
        )
    except Exception as e:
        report(error_type=type(e).__name__, error=str(e), seconds=time.monotonic() - t0)
        return
    print("STARTED", flush=True)
    saved = []
    start = (manager.latest_step() or 0) + 1
    try:
        for step in range(start, start + steps):
            tree = {"w": np.full((64, 32), step, np.float32), "step": step}
            manager.save(step, tree)
            saved.append(step)
            time.sleep(0.1)  # long enough for the second job to start meanwhile
        hold = os.environ.get("SNAPSHARD_TEST_HOLD_UNTIL")
        deadline = time.monotonic() + 120
        while hold and not os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)  # keep the root (and save more) until the test lets go
            step += 1
            manager.save(step, {"w": np.full((64, 32), step, np.float32), "step": step})
            saved.append(step)
        manager.close()
    except Exception as e:
        report(saved=saved, error_type=type(e).__name__, error=str(e))
        return
    report(saved=saved, steps=manager.all_steps())


if __name__ == "__main__":
    main()
