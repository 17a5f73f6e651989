"""One job of bench_interference.py: one save method on one state, in this fresh process,
measured against a stand-in training loop; prints one `RESULT {json}` line.

The stand-in loop is a fixed slice of pure-Python work per step (dict and list operations,
calibrated to `--step-ms` of CPU time): the part of a real training step that needs the
interpreter (dispatch, the input pipeline, logging). The job

1. builds the state and saves it once, unmeasured (imports, thread pools, plans, DCP's
   background process: what the first save of a run pays once);
2. runs the loop alone for `--baseline-s` / 2 seconds: its steps per second with no save;
3. starts the measured save: the blocking call is timed, then a watcher thread waits for
   the save with the library's own wait (`AsyncSave.wait`, the manager's
   `wait_until_finished`, Orbax's `wait_until_finished`, DCP's future), while the main
   thread runs the loop until the watcher says the save is done. The window from the
   blocking call's return to the wait's return is the background phase;
4. runs the loop alone again for `--baseline-s` / 2 seconds (half of the rate alone is
   measured before the save, half after it).

Reported: the loop's rate during the background phase over its rate alone (1.0: the save
costs the loop nothing), the longest gap between consecutive step ends in the window (a
stall of the loop; the loop alone's longest gap beside it), the blocking time and the
background time. The watcher sleeps in a C-level wait that releases the interpreter, so it
takes nothing from the loop itself.

Methods. JAX (jax.Arrays on `--devices` CPU devices, cut on their first axis):
  jax_async         snapshard.save_async
  jax_manager       snapshard.CheckpointManager (asynchronous, keeps every step)
  *_proc            the same with SaveOptions(background="process"): the background phase
                    in a writer process
  jax_local         the same with a LocalTier (every step to both tiers; one process, so no
                    peer copies)
  orbax             ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
torch (CPU tensors, one gloo rank; where the machine refuses TCP sockets, no process group,
and dcp_process, which needs one, fails):
  torch_async       snapshard.torch.save_async (torch_async_proc: in a writer process)
  torch_dcp_writer  dcp.async_save with snapshard.torch.StorageWriter (thread executor)
  dcp_thread        dcp.async_save with DCP's FileSystemWriter, thread executor
  dcp_process       the same with the process executor
The machine's floor, no library at all: what any background work costs the loop here.
  floor_write       a process of its own, started with the job, writes the state's bytes
                    (random, as many files as the state has arrays for 'large', one file
                    for 'many') and fsyncs them: the least a writer of these bytes costs
  floor_spin        a process of its own runs the loop's pure-Python work for as long as
                    --spin-s: what one busy core beside the loop costs it
States: 'large', 24 float32 arrays of (4096 x scale, 2048) (805 MB at scale 1); 'many',
`--arrays` float32 arrays of `--side` x `--side` (10,000 of 64 x 64: 164 MB).
A method that fails prints its error in the RESULT (`error`) instead of figures.

usage: python job_interference.py METHOD --state large|many [--scale S] [--arrays N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as bc

JAX_METHODS = (
    "jax_async",
    "jax_async_proc",
    "jax_manager",
    "jax_manager_proc",
    "jax_local",
    "orbax",
)
TORCH_METHODS = ("torch_async", "torch_async_proc", "torch_dcp_writer", "dcp_thread", "dcp_process")
FLOOR_METHODS = ("floor_write", "floor_spin")
METHODS = JAX_METHODS + TORCH_METHODS + FLOOR_METHODS
LARGE_ARRAYS, LARGE_COLS = 24, 2048  # 24 x (4096, 2048) float32 = 805,306,368 B at scale 1


# ---------------------------------------------------------------- the stand-in loop
def python_work(n: int) -> int:
    """n rounds of dict and list operations: pure interpreter work, holding the GIL all
    along, as a training step's dispatch and input pipeline do."""
    counts: dict[int, int] = {}
    items: list[tuple[int, str]] = []
    for i in range(n):
        k = i % 97
        counts[k] = counts.get(k, 0) + i
        if i % 8 == 0:
            items.append((i, str(i)))
    return len(counts) + len(items)


def calibrate(step_ms: float) -> int:
    """The rounds of python_work that take about step_ms of this thread's CPU time (CPU
    time, not wall time: on a busy machine a wall-clock probe measures the other
    processes too). Two refinements from a first guess, each the median of several
    timings. Where the thread's CPU clock is too coarse to time a step (it reads 0), the
    wall clock."""
    rounds = 2000
    clock = time.thread_time
    for _ in range(3):
        times = []
        for _ in range(7):
            t0 = clock()
            python_work(rounds)
            times.append(clock() - t0)
        if statistics.median(times) <= 0:
            clock = time.perf_counter
            continue
        rounds = max(1, round(rounds * step_ms / 1000 / statistics.median(times)))
    return rounds


@dataclass
class Window:
    """The loop's step ends within [start, end]: its rate and its longest gap."""

    start: float
    end: float
    ends: list[float]

    @property
    def rate(self) -> float:
        """Steps per second: the steps that ended in the window over its length."""
        n = sum(1 for t in self.ends if t <= self.end)
        return n / (self.end - self.start) if self.end > self.start else 0.0

    @property
    def longest_gap_s(self) -> float:
        """The longest time between consecutive step ends (the window's start counts as
        one), the last step still running at the window's end included."""
        marks = [self.start, *(t for t in self.ends if t <= self.end), self.end]
        return max(b - a for a, b in pairwise(marks))


def run_loop(rounds: int, until: Callable[[], bool]) -> tuple[float, list[float]]:
    """Run steps of `rounds` until `until()` is true after a step; returns the start time
    and the end time of every step."""
    ends: list[float] = []
    start = time.perf_counter()
    while not until():
        python_work(rounds)
        ends.append(time.perf_counter())
    return start, ends


def baseline(rounds: int, seconds: float) -> Window:
    """The loop alone for `seconds`."""
    deadline = time.perf_counter() + seconds
    start, ends = run_loop(rounds, lambda: time.perf_counter() >= deadline)
    return Window(start, ends[-1], ends)


class Watcher:
    """Waits for a save in a thread of its own, started before the save (`watch` hands it the
    library's wait: a thread started just after the blocking phase would wait for the
    interpreter with the loop, a cost of the bench, not of the library); `done` is set, with
    the time and any error, when the library's wait returns."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.end = 0.0
        self.error: BaseException | None = None
        self._wait: Callable[[], Any] | None = None
        self._given = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench watcher", daemon=True)
        self._thread.start()

    def watch(self, wait: Callable[[], Any]) -> None:
        self._wait = wait
        self._given.set()

    def _run(self) -> None:
        self._given.wait()
        assert self._wait is not None
        try:
            self._wait()
        except BaseException as e:  # reported in the RESULT, not lost
            self.error = e
        finally:
            self.end = time.perf_counter()
            self.done.set()

    def join(self) -> None:
        self._thread.join()


# ---------------------------------------------------------------- a save method
@dataclass
class Method:
    """A save method. `state()` makes the state to save (untimed); `start(tag, state)` runs
    the blocking phase of a save named `tag` and returns a callable that waits for its
    background phase; `close()` ends what the method holds."""

    state: Callable[[], Any]
    start: Callable[[str, Any], Callable[[], Any]]
    close: Callable[[], None]
    nbytes: int


def host_state(args: argparse.Namespace) -> dict[str, Any]:
    """The state as float32 NumPy arrays: 'large' is 24 arrays of (rows, 2048), rows from
    --scale as in common.rows_for; 'many' is --arrays arrays of --side x --side."""
    import numpy as np

    rng = np.random.default_rng(0)
    if args.state == "large":
        shape = (bc.rows_for(args.scale), LARGE_COLS)
        return {
            f"layers.{i:02d}.w": rng.standard_normal(shape, np.float32) for i in range(LARGE_ARRAYS)
        }
    block = rng.standard_normal((args.arrays, args.side, args.side), np.float32)
    return {f"leaves.{i:06d}": block[i].copy() for i in range(args.arrays)}


def _jax_arrays(host: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """A function making new jax.Arrays of the host arrays, cut on their first axis over
    every device: a training loop saves new arrays every time, and JAX keeps the host copy
    of an array once fetched."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    cut = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec("d"))

    def fresh() -> dict[str, Any]:
        arrays = jax.device_put(list(host.values()), [cut] * len(host))
        return dict(zip(host, jax.block_until_ready(arrays), strict=True))

    return fresh


def jax_method(args: argparse.Namespace, root: str) -> Method:
    """snapshard's save_async, its manager (with the local tier: jax_local) or Orbax's
    AsyncCheckpointer, on jax.Arrays."""
    import snapshard

    host = host_state(args)
    fresh, nbytes = _jax_arrays(host), sum(v.nbytes for v in host.values())
    opts = snapshard.SaveOptions(
        background="process" if args.method.endswith("_proc") else "thread"
    )
    if args.method == "orbax":
        import orbax.checkpoint as ocp

        ckptr = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())

        def orbax_start(tag: str, tree: Any) -> Callable[[], Any]:
            ckptr.save(os.path.join(root, tag), args=ocp.args.StandardSave(tree))
            return ckptr.wait_until_finished

        return Method(fresh, orbax_start, ckptr.close, nbytes)
    if args.method.startswith("jax_async"):

        def async_start(tag: str, tree: Any) -> Callable[[], Any]:
            return snapshard.save_async(os.path.join(root, tag), tree, opts).wait

        return Method(fresh, async_start, lambda: None, nbytes)
    tier = None
    if args.method == "jax_local":
        tier = snapshard.LocalTier(os.path.join(root, "local"), interval=1, max_to_keep=2)
    # No retention: its deletions would run after the commit, in the measured window.
    manager = snapshard.CheckpointManager(
        os.path.join(root, "steps"), local_tier=tier, save_options=opts
    )
    steps = iter(range(1, 1 << 30))

    def manager_start(tag: str, tree: Any) -> Callable[[], Any]:
        manager.save(next(steps), tree)
        return manager.wait_until_finished

    return Method(fresh, manager_start, manager.close, nbytes)


def torch_method(args: argparse.Namespace, root: str) -> Method:
    """snapshard.torch's save_async, or DCP's async_save with snapshard's StorageWriter or
    DCP's FileSystemWriter (thread or process executor), on CPU tensors in one gloo rank
    (DCP's async save needs a process group). Every save gets the same tensors, as a
    training loop's state dict."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import (
        AsyncCheckpointerType,
        AsyncSaveResponse,
    )

    import snapshard.torch as sst

    group = _tcp_allowed()
    if group:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # where DCP's process executor listens
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{bc.free_port()}", rank=0, world_size=1
        )
    elif args.method == "dcp_process":
        raise RuntimeError("DCP's process executor needs a process group; this machine refuses TCP")
    state = {k: torch.from_numpy(v) for k, v in host_state(args).items()}
    nbytes = sum(t.nbytes for t in state.values())
    if args.method.startswith("torch_async"):
        opts = sst.SaveOptions(background="process" if args.method.endswith("_proc") else "thread")

        def async_start(tag: str, sd: Any) -> Callable[[], Any]:
            return sst.save_async(os.path.join(root, tag), sd, opts).wait

        return Method(lambda: state, async_start, lambda: _close_dcp(dist), nbytes)
    executor = (
        AsyncCheckpointerType.PROCESS
        if args.method == "dcp_process"
        else AsyncCheckpointerType.THREAD
    )

    def dcp_start(tag: str, sd: Any) -> Callable[[], Any]:
        path = os.path.join(root, tag)
        writer = (
            sst.StorageWriter(path)
            if args.method == "torch_dcp_writer"
            else dcp.FileSystemWriter(path)
        )
        fut = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=executor)
        # A Future, or (with a non-blocking stager) a response whose upload_completion is
        # the save's end.
        if isinstance(fut, AsyncSaveResponse):
            return fut.upload_completion.result
        return fut.result

    return Method(lambda: state, dcp_start, lambda: _close_dcp(dist), nbytes)


def _close_dcp(dist: Any) -> None:
    """Stop DCP's background process (the process executor keeps one for the job), then
    the process group."""
    with contextlib.suppress(Exception):
        from torch.distributed.checkpoint import _async_process_executor as ape

        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        if proc is not None:
            proc.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _tcp_allowed() -> bool:
    """Whether this machine lets the job open a TCP socket (gloo needs one; some sandboxes
    allow unix sockets only)."""
    try:
        bc.free_port()
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- the machine's floor
def floor_method(args: argparse.Namespace, root: str) -> Method:
    """A helper process of its own (no library), started here and told to go once per save;
    the wait reads its answer. See the module docstring."""
    import subprocess

    host = host_state(args)
    sizes = (
        [v.nbytes for v in host.values()]
        if args.state == "large"
        else [sum(v.nbytes for v in host.values())]
    )
    del host
    what = "spin" if args.method == "floor_spin" else "write"
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--floor-child", what, root,
         ",".join(map(str, sizes)), str(calibrate(args.step_ms)), str(args.spin_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the floor's helper did not start (exit {child.wait()})")

    def go(tag: str, _state: Any) -> Callable[[], Any]:
        child.stdin.write(tag + "\n")
        child.stdin.flush()

        def wait() -> None:
            if child.stdout.readline().strip() != "done":
                raise RuntimeError(f"the floor's helper failed (exit {child.wait()})")

        return wait

    def close() -> None:
        child.stdin.close()
        child.wait(timeout=60)

    return Method(lambda: None, go, close, sum(sizes))


def floor_child(what: str, root: str, sizes: str, rounds: int, spin_s: float) -> None:
    """The floor's helper: answers 'ready', then for each tag read from stdin writes the
    bytes (each file and the directory fsync'd) or spins, and answers 'done'."""
    import numpy as np

    rng = np.random.default_rng(1)
    data = [rng.bytes(int(n)) for n in sizes.split(",")] if what == "write" else []
    print("ready", flush=True)
    for line in sys.stdin:
        tag = line.strip()
        if what == "spin":
            deadline = time.perf_counter() + spin_s
            while time.perf_counter() < deadline:
                python_work(rounds)
        else:
            for i, buf in enumerate(data):
                bc.write_durable(os.path.join(root, tag), f"{i}.bin", [buf])
        print("done", flush=True)


# ---------------------------------------------------------------- the job
def measure(method: Method, rounds: int, baseline_s: float) -> dict[str, Any]:
    """The loop alone (half of `baseline_s` before the save, half after it, so that a drift
    of the machine's load meets both sides), and the measured save with the loop running
    through its background phase; figures in seconds and steps per second."""
    state = method.state()
    before = baseline(rounds, baseline_s / 2)
    watcher = Watcher()
    t0 = time.perf_counter()
    wait = method.start("measured", state)
    t1 = time.perf_counter()
    cpu0, loop0 = time.process_time(), time.thread_time()
    watcher.watch(wait)
    _, ends = run_loop(rounds, watcher.done.is_set)
    cpu1, loop1 = time.process_time(), time.thread_time()
    watcher.join()
    if watcher.error is not None:
        raise watcher.error
    after = baseline(rounds, baseline_s / 2)
    during = Window(t1, watcher.end, ends)
    rate_alone = (len(before.ends) + len(after.ends)) / (
        before.end - before.start + after.end - after.start
    )
    return {
        "rate_alone": round(rate_alone, 2),
        "rate_during": round(during.rate, 2),
        "rate_ratio": round(during.rate / rate_alone, 4),
        "stall_s": round(during.longest_gap_s, 5),
        "stall_alone_s": round(max(before.longest_gap_s, after.longest_gap_s), 5),
        "steps_during": sum(1 for t in ends if t <= watcher.end),
        "blocking_s": round(t1 - t0, 5),
        "background_s": round(watcher.end - t1, 4),
        # The training process's CPU time during the background phase outside the loop's
        # thread: the library's threads (serving a writer process, or writing themselves).
        "other_threads_cpu_s": round((cpu1 - cpu0) - (loop1 - loop0), 4),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the method, save once unmeasured, then measure one save."""
    root = bc.ckpt_dir(f"interference-{args.method}")
    bc.fresh_dir(root)
    os.makedirs(root)
    try:
        build = (
            jax_method
            if args.method in JAX_METHODS
            else floor_method
            if args.method in FLOOR_METHODS
            else torch_method
        )
        method = build(args, root)
        try:
            method.start("warm-up", method.state())()
            bc.settle()  # the warm-up's dirty pages are not the measured save's to write
            rounds = calibrate(args.step_ms)
            figures = measure(method, rounds, args.baseline_s)
        finally:
            method.close()
    finally:
        bc.remove(root)
    return {"bytes": method.nbytes, "work_rounds": rounds, **figures}


def main() -> None:
    if sys.argv[1:2] == ["--floor-child"]:
        what, root, sizes, rounds, spin_s = sys.argv[2:7]
        floor_child(what, root, sizes, int(rounds), float(spin_s))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("method", choices=METHODS)
    ap.add_argument("--state", choices=["large", "many"], required=True)
    ap.add_argument("--scale", type=float, default=1.0, help="large: rows x scale")
    ap.add_argument("--arrays", type=int, default=10_000, help="many: how many arrays")
    ap.add_argument("--side", type=int, default=64, help="many: arrays of side x side")
    ap.add_argument("--devices", type=int, default=1, help="JAX: CPU devices, arrays cut on axis 0")
    ap.add_argument("--step-ms", type=float, default=1.5)
    ap.add_argument("--baseline-s", type=float, default=2.0)
    ap.add_argument("--spin-s", type=float, default=2.0, help="floor_spin: seconds per save")
    ap.add_argument("--round", type=int, default=0)
    args = ap.parse_args()
    if args.method in JAX_METHODS:
        bc.force_cpu_devices(args.devices)
    head = {"method": args.method, "state": args.state, "round": args.round}
    try:
        bc.emit(**head, **run(args))
    except Exception as e:  # the driver prints it in the method's row
        bc.emit(**head, error=f"{type(e).__name__}: {e}"[:300])


if __name__ == "__main__":
    main()
