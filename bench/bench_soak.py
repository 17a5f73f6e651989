"""Soak: many asynchronous saves of a changing state through a CheckpointManager that keeps
2 steps, watching the process's memory and open files. Staging memory must be reused,
not grown: a save's host buffers are exact, reused across saves of the same state and
released on close, so the resident memory after the first few saves stays flat.

Each step changes the whole state, as a training step does (JAX: a jitted `x + 1` makes
new arrays, the old ones are dropped; torch: `add_(1)` in place), then saves it with the
manager (`save` returns after the blocking phase). Before each save the bench waits for the
one in flight, as `save` itself would, so that the wait and the blocking phase are timed
apart. Every `--every` saves, and after the 10th, it waits for the new save too (every
sample is taken with no save running) and records the resident memory (VmRSS), the open
file descriptors (/proc/self/fd), the threads and the steps kept on disk. At the end,
after `close()`, once more.

Reported: a table of the samples, then the growth of the resident memory from the 10th
save to the last, to the largest sample after the 10th, and along the least-squares trend
of the samples from the 10th on, each as a fraction of the state's bytes (target <= 1%),
and the growth of open files from the 10th save to the last (target 0). The trend is the
figure that a sample's luck does not move: a JAX training step frees one whole state and
allocates the next, and whether the allocator still holds the freed one when a sample is
taken moves a single sample by up to the state's size.

With `--trim`, each sample is taken twice: as it is, then once the C allocator has given
back the free pages it holds (glibc's `malloc_trim(0)`). The second is nearly the memory the
process uses, without most of what the allocator keeps of freed memory, which for JAX
(XLA's buffers of freed states, kept in the arenas of the threads that made them) is most
of what moves the first, by up to a few states. Nearly: the trim gives back free pages in
the allocator's bins, and the free top of the main arena, but not the free top of another
thread's arena, which stays resident until that arena grows past it (glibc; a writer
thread's arena, a few MB, is seen to stay so for hundreds of saves). So with `--trim` each
sample also records the bytes that glibc's malloc has lent out and not had back
(`mallinfo2`: in use in its arenas, plus its blocks of their own mmap; glibc 2.33 on):
what a leak of native memory (array buffers, XLA's, torch's, NumPy's) grows, and nothing
the allocator keeps of freed memory. Python's own small objects live in pools of Python's,
outside it (tracemalloc sees those; they are in the resident memory). The trim changes
what later samples find held, so a run with it is not compared with one without. The
memory the manager's saves stage into (torch: a copy of every byte; JAX: the host values'
copies) is released by `close()`: the sample after it shows it gone.

What the allocator keeps moves with glibc's dynamic mmap threshold: once a block that had
a mmap of its own is freed, the threshold rises to its size, and blocks up to it are
served from the arenas from then on, where they stay when freed instead of going back to
the system. With `MALLOC_MMAP_THRESHOLD_=131072` in the environment the threshold stays
fixed, large blocks go back when freed, and the resident memory shows what the process
holds without the allocator's jumps (JAX's of up to a few states, torch's of a few MB).

    python bench/bench_soak.py                           # 1,000 saves of 64 MB, JAX
    python bench/bench_soak.py --framework torch --state-mb 256
    python bench/bench_soak.py --saves 50 --every 10     # a quick check
    python bench/bench_soak.py --trim                    # also the memory in use
    python bench/bench_soak.py --baseline --trim         # the steps alone, no saves
    MALLOC_MMAP_THRESHOLD_=131072 python bench/bench_soak.py --trim   # no dynamic threshold

`--baseline` runs the same steps and samples with no manager and no save (JAX: waiting for
each step's arrays, as a save's blocking phase does): what the framework and the allocator
do alone, the figure a soak's is read against.

Checkpoints go under $SNAPSHARD_BENCH_DIR (common.bench_dir) and are deleted at the end.
Writes the samples as JSON lines (--out, default bench/results/soak-<time>.jsonl).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from operator import attrgetter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc

HERE = os.path.dirname(os.path.abspath(__file__))
SETTLED_AFTER = 10  # saves before memory is expected flat (first allocations, plans, pools)
TARGET_RSS_FRACTION, TARGET_FD_GROWTH = 0.01, 0
COLS = 1024  # every array is (rows, 1024) float32


# ---------------------------------------------------------------- the process, observed
def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)", f.read(), re.M)
    return int(m.group(1)) * 1024 if m else 0


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0), which gives back the free pages of every arena; None elsewhere."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]

    def run() -> None:
        trim(0)

    return run


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _malloc_lent() -> Callable[[], int] | None:
    """The bytes glibc's malloc has lent out and not had back: mallinfo2's `uordblks` (in use
    in its arenas) plus `hblkhd` (its blocks of their own mmap); None without mallinfo2."""
    name = ctypes.util.find_library("c")
    info = getattr(ctypes.CDLL(name), "mallinfo2", None) if name else None
    if info is None:
        return None
    info.restype = _MallInfo2

    def run() -> int:
        m = info()
        return int(m.uordblks + m.hblkhd)

    return run


@dataclass
class Sample:
    """The process after `saves` saves (no save in flight). `in_use_B`: the resident memory
    once the allocator gave back its free pages (--trim), else None; `malloc_B`: the bytes
    malloc has lent out and not had back (--trim, with glibc's mallinfo2), else None."""

    saves: int
    elapsed_s: float
    rss_B: int
    open_fds: int
    threads: int
    steps_kept: int
    in_use_B: int | None = None
    malloc_B: int | None = None


def sample(
    saves: int,
    t0: float,
    directory: str,
    trim: Callable[[], None] | None = None,
    lent: Callable[[], int] | None = None,
) -> Sample:
    s = Sample(
        saves=saves,
        elapsed_s=round(time.perf_counter() - t0, 2),
        rss_B=_status_bytes("VmRSS"),
        open_fds=len(os.listdir("/proc/self/fd")),
        threads=len(os.listdir("/proc/self/task")),
        steps_kept=sum(1 for n in os.listdir(directory) if n.isdigit())
        if os.path.isdir(directory)
        else 0,
    )
    if trim is not None:
        trim()
        s.in_use_B = _status_bytes("VmRSS")
    if lent is not None:
        s.malloc_B = lent()
    return s


# ---------------------------------------------------------------- the state and its step
def array_rows(args: argparse.Namespace) -> int:
    """Rows of each of the --arrays (rows, COLS) float32 arrays, so the state is ~--state-mb."""
    return max(1, round(args.state_mb * 1e6 / args.arrays / (COLS * 4)))


def jax_state(args: argparse.Namespace) -> tuple[Any, Callable[[Any], Any], Any]:
    """JAX: the state as jax.Arrays, the training step (new arrays, the old dropped) and the
    manager's class."""
    import jax
    import jax.numpy as jnp

    import snapshard

    rows = array_rows(args)
    state = {
        f"layers.{i:03d}.w": jnp.full((rows, COLS), float(i), jnp.float32)
        for i in range(args.arrays)
    }
    step = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t))
    return jax.block_until_ready(state), step, snapshard.CheckpointManager


def ready(framework: str) -> Callable[[Any], Any]:
    """Waits for a step's arrays (JAX dispatches steps asynchronously; torch's are done)."""
    if framework == "jax":
        import jax

        return jax.block_until_ready
    return lambda state: state


def torch_state(args: argparse.Namespace) -> tuple[Any, Callable[[Any], Any], Any]:
    """torch: the state dict of CPU tensors, the training step (in place, as an optimizer
    steps) and the manager's class."""
    import torch

    import snapshard.torch as sst

    rows = array_rows(args)
    state = {
        f"layers.{i:03d}.w": torch.full((rows, COLS), float(i), dtype=torch.float32)
        for i in range(args.arrays)
    }

    def step(sd: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            for t in sd.values():
                t.add_(1)
        return sd

    return state, step, sst.CheckpointManager


# ---------------------------------------------------------------- the soak
def soak(
    args: argparse.Namespace, directory: str, out: Any
) -> tuple[list[Sample], int, dict[str, float]]:
    """The saves; returns the samples (the last one after close), the state's bytes and the
    median times of a save: `drain_s`, the wait for the save before it (which `save` would
    do itself), and `blocking_s`, the save's own blocking phase (none with --baseline: the
    steps alone, no manager)."""
    make = jax_state if args.framework == "jax" else torch_state
    trim = _malloc_trim() if args.trim else None
    if args.trim and trim is None:
        raise SystemExit("--trim needs glibc's malloc_trim")
    lent = _malloc_lent() if args.trim else None
    state, step, manager_cls = make(args)
    nbytes = array_rows(args) * COLS * 4 * args.arrays
    at = {SETTLED_AFTER, args.saves, *range(args.every, args.saves + 1, args.every)}
    samples: list[Sample] = []
    drain: list[float] = []
    blocking: list[float] = []
    t0 = time.perf_counter()
    wait = ready(args.framework)
    manager = None if args.baseline else manager_cls(directory, max_to_keep=args.keep)
    try:
        samples.append(sample(0, t0, directory, trim, lent))
        for i in range(1, args.saves + 1):
            state = step(state)
            if manager is None:  # --baseline
                wait(state)
                if i in at:
                    samples.append(
                        record(sample(i, t0, directory, trim, lent), nbytes, samples, out)
                    )
                continue
            t1 = time.perf_counter()
            manager.wait_until_finished()  # apart, so that blocking is the save's own
            t2 = time.perf_counter()
            manager.save(i, state)
            drain.append(t2 - t1)
            blocking.append(time.perf_counter() - t2)
            if i in at:
                manager.wait_until_finished()  # every sample with no save in flight
                samples.append(record(sample(i, t0, directory, trim, lent), nbytes, samples, out))
    finally:
        if manager is not None:
            manager.close()
    closed = sample(args.saves, t0, directory, trim, lent)
    samples.append(record(closed, nbytes, samples, out, closed=True))
    if not blocking:
        return samples, nbytes, {}
    med = statistics.median
    return samples, nbytes, {"drain_s": med(drain), "blocking_s": med(blocking)}


def record(s: Sample, nbytes: int, before: list[Sample], out: Any, closed: bool = False) -> Sample:
    """Write the sample as a JSON line and print its progress line."""
    out.write(json.dumps({**asdict(s), "state_B": nbytes, "closed": closed}) + "\n")
    out.flush()
    base = settled(before) or s
    in_use = ""
    if s.in_use_B is not None and base.in_use_B is not None:
        in_use = f", in use {s.in_use_B / 1e6:.1f} MB ({(s.in_use_B - base.in_use_B) / 1e6:+.1f})"
    if s.malloc_B is not None and base.malloc_B is not None:
        in_use += (
            f", malloc'd {s.malloc_B / 1e6:.1f} MB ({(s.malloc_B - base.malloc_B) / 1e6:+.2f})"
        )
    print(
        f"{'closed' if closed else 'save'} {s.saves}: RSS {s.rss_B / 1e6:.1f} MB "
        f"({(s.rss_B - base.rss_B) / 1e6:+.1f} MB from save {base.saves}){in_use}, "
        f"{s.open_fds} open files, {s.threads} threads, {s.steps_kept} steps kept, "
        f"{s.elapsed_s:.0f} s",
        flush=True,
    )
    return s


def settled(samples: list[Sample]) -> Sample | None:
    """The sample after the first SETTLED_AFTER saves: the base of every growth."""
    return next((s for s in samples if s.saves == SETTLED_AFTER), None)


# ---------------------------------------------------------------- the report
def trend(samples: list[Sample], of: Callable[[Sample], int] = lambda s: s.rss_B) -> float:
    """Bytes of resident memory (`of` a sample) gained per save, the least-squares slope over
    the samples: unlike the growth between two samples, it does not move with what the
    allocator happens to hold at one of them (a JAX step frees a whole state and allocates
    another)."""
    return statistics.linear_regression([s.saves for s in samples], [of(s) for s in samples])[0]


def growth_checks(
    name: str, of: Callable[[Sample], int], base: Sample, settled_samples: list[Sample], nbytes: int
) -> list[tuple[str, float]]:
    """The growth of `name` (`of` a sample) from save 10 to the last sample, to the largest,
    and along the trend, each / the state's bytes."""
    last = settled_samples[-1]
    peak = max(of(s) for s in settled_samples)
    checks = [
        (f"{name} growth, save 10 to the last, / state", (of(last) - of(base)) / nbytes),
        (f"{name} growth, save 10 to the largest sample after it, / state", (peak - of(base)) / nbytes),
    ]  # fmt: skip
    if len(settled_samples) >= 3:
        slope = trend(settled_samples, of)
        checks.append(
            (
                f"{name} trend from save 10 to the last (least squares), / state",
                slope * (last.saves - base.saves) / nbytes,
            )
        )
    return checks


def report(
    samples: list[Sample], nbytes: int, times: dict[str, float], args: argparse.Namespace
) -> None:
    base = settled(samples)
    open_samples = samples[1:-1]  # not the one before the first save, nor after close
    if args.baseline:
        print(
            f"\n## Soak baseline: {args.saves} steps of {nbytes / 1e6:.1f} MB "
            f"({args.arrays} arrays, {args.framework}), no saves\n"
        )
    else:
        print(
            f"\n## Soak: {args.saves} asynchronous saves of {nbytes / 1e6:.1f} MB "
            f"({args.arrays} arrays, {args.framework}), manager keeping {args.keep}\n"
        )
    # the figures beyond RSS that every sample has (--trim): their names and Sample fields
    more = [
        (name, field)
        for name, field in (("in use", "in_use_B"), ("malloc'd", "malloc_B"))
        if all(getattr(s, field) is not None for s in samples)
    ]
    extra = "".join(f" {n} MB | {n} growth MB | % of state |" for n, _ in more)
    print("| saves | elapsed s | RSS MB | RSS growth from save 10 MB | % of state | open files | threads | steps kept |" + extra)  # fmt: skip
    print("|---|---|---|---|---|---|---|---|" + "---|---|---|" * len(more))
    for i, s in enumerate(samples):
        label = "after close" if i == len(samples) - 1 else str(s.saves)
        grow = (s.rss_B - base.rss_B) if base else 0
        row = (f"| {label} | {s.elapsed_s:.1f} | {s.rss_B / 1e6:.1f} | {grow / 1e6:+.2f} "
               f"| {100 * grow / nbytes:+.2f} | {s.open_fds} | {s.threads} | {s.steps_kept} |")  # fmt: skip
        for _, field in more:
            held: int = getattr(s, field)
            used = held - getattr(base, field) if base else 0
            row += f" {held / 1e6:.1f} | {used / 1e6:+.2f} | {100 * used / nbytes:+.2f} |"
        print(row)
    if times:
        print(
            f"\nmedian per save: blocking {times['blocking_s'] * 1e3:.1f} ms; waiting for the "
            f"save before it {times['drain_s'] * 1e3:.1f} ms (the background phase left when "
            "the next step's save starts)"
        )
    if base is None or not open_samples:
        print(f"fewer than {SETTLED_AFTER} saves: no growth to report")
        return
    last = open_samples[-1]
    settled_samples = [s for s in open_samples if s.saves >= SETTLED_AFTER]
    checks = growth_checks("RSS", lambda s: s.rss_B, base, settled_samples, nbytes)
    for name, field in more:
        checks += growth_checks(name, attrgetter(field), base, settled_samples, nbytes)
    print("\n| figure | value | target | met |\n|---|---|---|---|")
    for name, value in checks:
        met = "yes" if value <= TARGET_RSS_FRACTION else "NO"
        print(f"| {name} | {100 * value:+.2f}% | <= {100 * TARGET_RSS_FRACTION:g}% | {met} |")
    fds = last.open_fds - base.open_fds
    print(f"| open files, save 10 to the last | {fds:+d} | {TARGET_FD_GROWTH} | "
          f"{'yes' if fds <= TARGET_FD_GROWTH else 'NO'} |")  # fmt: skip
    if not args.baseline:
        print(f"| steps kept on disk at the end | {last.steps_kept} | {args.keep} | "
              f"{'yes' if last.steps_kept == args.keep else 'NO'} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--saves", type=int, default=1000)
    ap.add_argument("--state-mb", type=float, default=64.0)
    ap.add_argument("--arrays", type=int, default=32)
    ap.add_argument("--framework", choices=["jax", "torch"], default="jax")
    ap.add_argument("--keep", type=int, default=2, help="the manager's max_to_keep")
    ap.add_argument("--every", type=int, default=100, help="saves between samples")
    ap.add_argument(
        "--trim",
        action="store_true",
        help="also sample the memory in use: after glibc's malloc_trim(0) (see above)",
    )
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="the steps alone, sampled alike, with no manager and no save (see above)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.framework == "jax":
        bc.force_cpu_devices(1)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"soak-{stamp}.jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    directory = bc.ckpt_dir(f"soak-{args.framework}")
    bc.fresh_dir(directory)
    try:
        with open(out_path, "a") as out:
            samples, nbytes, times = soak(args, directory, out)
    finally:
        bc.remove(directory)
    report(samples, nbytes, times, args)
    print(f"\nresults: {out_path}")


if __name__ == "__main__":
    main()
