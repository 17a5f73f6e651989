"""The peer bench's snapshard job (job_snapshard.py: durable save, warm restore, reshard,
evicted restore of the ~2 GiB state) run alternately with the library of an earlier commit
and with the working tree, in fresh processes, rounds interleaved: medians and paired ratios.

    python ab_versions.py [--rev 30e3f53] [--rounds 3] [--scale 1.0] [--rev-src DIR]

--rev-src: the earlier library's `src` directory, already extracted (`git archive REV src`),
for a machine without the repository's history; --rev then only names it. --new-src: the
later library's, in place of the working tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from common import library_at, ratio_table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = ("blocking_s", "save_s", "restore_warm_s", "reshard_warm_s", "restore_evicted_s")


def job(src: str, scale: float, r: int) -> dict:
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=src + (os.pathsep + path if path else ""))
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "job_snapshard.py"), "--scale", str(scale), "--round", str(r)],
        env=env, capture_output=True, text=True, check=True, cwd=HERE,
    )  # fmt: skip
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    res = json.loads(line[7:])
    assert res["bit_exact"], "restore was not bit-exact"
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="30e3f53")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rev-src", default=None)
    ap.add_argument("--new-src", default=os.path.join(ROOT, "src"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.abspath(args.rev_src) if args.rev_src else library_at(args.rev, tmp)
        sources = {args.rev: old, "working tree": os.path.abspath(args.new_src)}
        runs: dict[str, list[dict]] = {k: [] for k in sources}
        for r in range(args.rounds):
            order = list(sources) if r % 2 == 0 else list(sources)[::-1]
            for name in order:
                runs[name].append(job(sources[name], args.scale, r))
    old, new = (runs[k] for k in sources)
    checks = [
        (f"{step}: working tree / {args.rev}", [n[step] / o[step] for o, n in zip(old, new, strict=True)], "<= 1.0")
        for step in STEPS
        if step in old[0]
    ]  # fmt: skip
    for name, rs in runs.items():
        print(name, {s: sorted(x[s] for x in rs) for s in STEPS if s in rs[0]})
    ratio_table(f"peer-bench state, {args.rounds} interleaved rounds", checks)


if __name__ == "__main__":
    main()
