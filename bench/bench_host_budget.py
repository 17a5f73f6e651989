"""save_async with a host budget, in the writer process beside threads: the whole save
(blocking call to `wait`) of JAX arrays on the default device with `host_budget` None and a
quarter of the state, each round both backgrounds, every save checked against the state,
and how many items the writer asked the training process to stage (`Exposure.stage`:
the items beyond the budget, copied from the device when they are written).

On a CPU device the arrays are staged as views, so nothing is left to the background
phase; run it where the arrays live on an accelerator.

usage: python bench/bench_host_budget.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import snapshard
    from snapshard import SaveOptions
    from snapshard.saving import writer_exposure as we

    calls: list[int] = []
    real = we.Exposure.stage

    def counted(self: we.Exposure, j: int) -> int:
        calls.append(j)
        return real(self, j)

    we.Exposure.stage = counted  # type: ignore[method-assign]
    print("backend", jax.default_backend(), jax.devices())
    root = tempfile.mkdtemp()
    print(
        "| arrays | MB | background | host budget | whole save ms | items staged by the writer | equal |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, side in ((16, 1024), (2000, 64)):
        state = {
            f"w{i}": jnp.full((side, side), i, jnp.float32) + jnp.arange(side, dtype=jnp.float32)
            for i in range(n)
        }
        jax.block_until_ready(state)
        total = sum(x.nbytes for x in state.values())
        times: dict[tuple[str, int | None], list[float]] = {}
        staged: dict[tuple[str, int | None], int] = {}
        equal = True
        for r in range(args.rounds + 1):  # round 0 starts the writer: not counted
            for bg in ("process", "thread"):
                for budget in (None, total // 4):
                    calls.clear()
                    path = os.path.join(root, f"{n}-{r}-{bg}-{budget}")
                    t0 = time.perf_counter()
                    snapshard.save_async(
                        path, state, SaveOptions(background=bg, host_budget=budget)
                    ).wait(300)
                    took = time.perf_counter() - t0
                    out = snapshard.load(path)
                    equal &= all(np.array_equal(out[k], np.asarray(v)) for k, v in state.items())
                    if r:
                        times.setdefault((bg, budget), []).append(took)
                        staged[(bg, budget)] = len(calls)
        for (bg, budget), ts in times.items():
            print(
                f"| {n} | {total / 1e6:.0f} | {bg} | {budget} | {statistics.median(ts) * 1e3:.0f} "
                f"{[round(t * 1e3) for t in ts]} | {staged[(bg, budget)]} | {equal} |"
            )


if __name__ == "__main__":
    main()
