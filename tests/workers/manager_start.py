"""Multi-process worker: start a CheckpointManager on DIR and report what happened.

usage: manager_start.py DIR
"""

from __future__ import annotations

import sys

from _dist import init, report

from snapshard import ReadOptions, SaveOptions
from snapshard.manager import LeasePolicy, ManagerPolicies


def main() -> None:
    pid, _ = init()
    import snapshard

    try:
        # The lease and the clean-up when the manager is made, as a writer asks for them.
        eager = ManagerPolicies(lease=LeasePolicy(at_start=True))
        with snapshard.CheckpointManager(
            sys.argv[1],
            policies=eager,
            save_options=SaveOptions(timeout_s=30),
            read_options=ReadOptions(timeout_s=30),
        ) as m:
            report(ok=True, steps=m.all_steps(), pid=pid)
    except Exception as e:
        relayed = isinstance(e, snapshard.CoordinationError)  # learnt from another process
        report(ok=False, error_type=type(e).__name__, error=str(e), pid=pid, relayed=relayed)


if __name__ == "__main__":
    main()
