"""What the training process spends per asynchronous save when its writer process reads
through the shared window (where `process_vm_readv` is missing or forbidden, as under
gVisor): the time of its copies into the window outside the `pwritev(2)` calls (the
interpreter held) and inside them (let go), and the time it takes to find the items'
addresses, per save of `--arrays` float32 arrays of `--side` x `--side`.

    python bench/bench_window.py                     # 10,000 arrays of 64 x 64 (164 MB)
    python bench/bench_window.py --arrays 1000 --saves 3

The window is forced as the tests force it (writer_process._WINDOW_ONLY); the first save
(the writer's start) is not counted; medians [min-max] over the others. The last save is
loaded back and compared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arrays", type=int, default=10_000)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--saves", type=int, default=6)
    args = ap.parse_args()

    import snapshard
    from snapshard.saving import writer_exposure as we
    from snapshard.saving import writer_process as wp

    wp._WINDOW_ONLY = True
    spent = {"copy": 0.0, "call": 0.0, "where": 0.0}
    copy, call, where = we.Exposure.copy, we._pwritev, wp.addresses_of

    def timed(key: str, fn):  # type: ignore[no-untyped-def]
        def run(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        return run

    we.Exposure.copy = timed("copy", copy)  # type: ignore[method-assign]
    we._pwritev = timed("call", call)
    wp.addresses_of = timed("where", where)  # (where it is called)

    rng = np.random.default_rng(0)
    tree = {
        f"l{i:06d}": rng.standard_normal((args.side, args.side), np.float32)
        for i in range(args.arrays)
    }
    root = bc.ckpt_dir("window")
    bc.fresh_dir(root)
    rows = []
    try:
        for k in range(args.saves):
            spent.update(copy=0.0, call=0.0, where=0.0)
            opts = snapshard.SaveOptions(background="process")
            snapshard.save_async(os.path.join(root, str(k)), tree, opts).wait()
            rows.append((spent["copy"] - spent["call"], spent["call"], spent["where"]))
        out = snapshard.load(os.path.join(root, str(args.saves - 1)))
        assert all(np.array_equal(out[key], v) for key, v in tree.items()), "not equal"
    finally:
        bc.remove(root)
    rows = rows[1:]
    mb = sum(v.nbytes for v in tree.values()) / 1e6
    print(f"{args.arrays} arrays, {mb:.0f} MB, {len(rows)} saves (ms per save):")
    for i, what in enumerate(("copies, outside pwritev (interpreter held)",
                              "copies, inside pwritev (let go)",
                              "the items' addresses (interpreter held)")):  # fmt: skip
        print(f"  {what}: {bc.spread([r[i] * 1e3 for r in rows], 1)}")


if __name__ == "__main__":
    main()
