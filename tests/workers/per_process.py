"""Multi-process worker: per-process values, and trees that differ between processes.

usage: per_process.py MODE CKPT
   save     each process saves its own PerProcess iterator state beside shared values
   restore  each process restores (onto any process count; `resplit` when it differs)
   differ   process 1's NumPy leaf has other values: the save must fail naming the leaf
   shape    process 1's NumPy leaf has another shape
   key      a process-local PRNG key on each process (not the same value)
   extra    process 1's tree has a key more ('extra', before 'lr' in its tree)
   missing  process 1's tree lacks 'lr'
   uneven   loads with no target a checkpoint that only process 0 saved a PerProcess value in
            (torch, trees_differ: tests/workers/trees_differ.py uneven)
"""

from __future__ import annotations

import sys

from _dist import init, report

from snapshard import SaveOptions


def main() -> None:
    mode, ckpt = sys.argv[1], sys.argv[2]
    pid, _n = init()
    import jax
    import numpy as np

    import snapshard

    if mode == "restore":

        def resplit(name, values, me, count):
            # The saved positions, spread over the new processes round-robin.
            return {"next_index": sum(v["next_index"] for v in values[me::count])}

        out = snapshard.load(ckpt, resplit=resplit)
        tag = out["it"].get("tag")
        report(
            it=out["it"]["next_index"],
            tag=tag.decode() if tag else None,
            shared=out["shared"].tolist(),
        )
        return
    if mode == "uneven":
        got = snapshard.load(ckpt)
        report(loaded={k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in got.items()})
        return
    tree = {"shared": np.arange(4), "lr": 0.1}
    if mode == "save":
        tree["it"] = snapshard.PerProcess({"next_index": 3 + 4 * pid, "tag": f"host{pid}".encode()})
    elif mode == "differ":
        tree["shared"] = np.arange(4) + pid
    elif mode == "shape":
        tree["shared"] = np.arange(4 + pid)
    elif mode == "key":
        tree["key"] = jax.random.key(pid)
    elif mode == "extra" and pid == 1:
        tree = {"shared": tree["shared"], "extra": np.zeros(2), "lr": 0.1}
    elif mode == "missing" and pid == 1:
        del tree["lr"]
    try:
        snapshard.save(ckpt, tree, options=SaveOptions(timeout_s=60))
    except snapshard.SnapshardError as e:
        report(error=type(e).__name__, message=str(e))
        return
    report(ok=True)


if __name__ == "__main__":
    main()
