"""What a restart pays before its first save or restore: the import of the library, in fresh
processes, against the import of its peer.

    python bench/bench_import.py [--rounds 9]

Each round starts one process per entry, in an order rotated by the round, and times the
import in it (`time.perf_counter` around the import statement, after the interpreter is up):

    torch                    `import torch` (the floor of every torch entry)
    snapshard.torch          `import snapshard.torch`, and whether it imported JAX
    torch DCP                `import torch.distributed.checkpoint`
    snapshard                `snapshard.save` reached, JAX imported beforehand (untimed:
                             a JAX job has it already)
    orbax                    `import orbax.checkpoint`, JAX imported beforehand (skipped
                             where not installed)

Prints the median per entry and the ratios peer / snapshard paired by round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

ENTRIES = {  # name: (untimed setup, timed statement)
    "torch": ("", "import torch"),
    "snapshard.torch": ("", "import snapshard.torch"),
    "torch DCP": ("", "import torch.distributed.checkpoint"),
    "snapshard": ("import jax", "import snapshard; snapshard.save"),
    "orbax": ("import jax", "import orbax.checkpoint"),
}
PAIRS = [("torch DCP", "snapshard.torch"), ("orbax", "snapshard")]

_PROBE = """
import json, sys, time
{setup}
t = time.perf_counter()
{stmt}
print(json.dumps({{"s": time.perf_counter() - t, "jax": "jax" in sys.modules}}))
"""


def one(setup: str, stmt: str) -> dict | None:
    code = _PROBE.format(setup=setup, stmt=stmt)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        return None  # not installed here
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    names = list(ENTRIES)
    times: dict[str, list[float]] = {n: [] for n in names}
    loads_jax: dict[str, bool] = {}
    for r in range(args.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            got = one(*ENTRIES[n])
            if got is not None:
                times[n].append(got["s"])
                loads_jax[n] = got["jax"]
    print(f"{'import':<18}{'median s':>10}  JAX loaded after")
    for n in names:
        if times[n]:
            print(f"{n:<18}{statistics.median(times[n]):>10.3f}  {loads_jax[n]}")
        else:
            print(f"{n:<18}{'n/a':>10}  (not installed)")
    for peer, ours in PAIRS:
        if len(times[peer]) == len(times[ours]) == args.rounds:
            ratios = [p / o for p, o in zip(times[peer], times[ours], strict=True)]
            print(f"{peer} / {ours}: median ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
