"""What copying bytes costs a pure-Python training loop on this host, with no library at all:
the loop (job_interference.py's stand-in step) runs while the same bytes a save of 10,000
arrays of 16 KB moves (164 MB, 16 MiB per request, 2 ms apart) are copied

- by a thread of the loop's own process, its interpreter released for each copy: into a
  shared memory file with pwritev(2) (what a writer process's window asks of the training
  process, saving/writer_exposure.py), into its mapping with NumPy, or into a file with
  pwrite(2);
- by another process, from its own memory, the same two ways.

Per method: the loop's rate during the copies over its rate alone (paired, medians over
rounds) and the longest gap between its steps. Where a thread of the loop's process costs
the loop and another process does not, the cost is the host's (a sandbox that serves its
processes' memory operations in one place, gVisor say), not the interpreter's: a training
process that must copy its staged bytes for a writer pays it whoever makes the copy.

    python bench/bench_host_copies.py --rounds 3
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from job_interference import calibrate, python_work

STATE_BYTES, PIECE, REQUEST_PIECES, PAUSE_S = 164 << 20, 16 << 10, 1024, 0.002
METHODS = ("none", "thread_pwritev", "thread_numpy", "thread_file", "process_pwritev",
           "process_numpy")  # fmt: skip
IOVEC = np.dtype([("base", np.uint64), ("len", np.uint64)])


def _pwritev():
    call = ctypes.CDLL(None, use_errno=True).pwritev
    call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong]
    call.restype = ctypes.c_ssize_t
    return call


def copier(how: str, stop: threading.Event, path: str) -> None:
    """Copy the state's pieces, a request at a time, until `stop`: into a 64 MiB memfd with
    pwritev ("pwritev"), into its mapping with NumPy ("numpy"), into `path` ("file")."""
    state = np.ones(STATE_BYTES, np.uint8)
    fd = os.memfd_create("bench-window")
    os.ftruncate(fd, 64 << 20)
    window = np.frombuffer(mmap.mmap(fd, 0), np.uint8)
    out = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600) if how == "file" else -1
    pwritev = _pwritev()
    pieces = STATE_BYTES // PIECE
    while not stop.is_set():
        for a in range(0, pieces, REQUEST_PIECES):
            k = min(REQUEST_PIECES, pieces - a)
            if how == "pwritev":
                iov = np.empty(k, IOVEC)
                iov["base"] = state.ctypes.data + np.arange(a, a + k) * PIECE
                iov["len"] = PIECE
                pwritev(fd, iov.ctypes.data, k, 0)
            elif how == "numpy":
                np.copyto(window[: k * PIECE], state[a * PIECE : (a + k) * PIECE])
            else:
                os.pwrite(out, memoryview(state[a * PIECE : (a + k) * PIECE]), 0)
            if stop.wait(PAUSE_S):
                break
    if out >= 0:
        os.close(out)


def loop_rate(rounds: int, seconds: float) -> tuple[float, float]:
    """(steps per second, longest gap between step ends) of the loop for `seconds`."""
    t0 = last = time.perf_counter()
    end, n, gap = t0 + seconds, 0, 0.0
    while last < end:
        python_work(rounds)
        now = time.perf_counter()
        n, gap, last = n + 1, max(gap, now - last), now
    return n / (last - t0), gap


def measure(method: str, rounds: int, path: str) -> tuple[float, float]:
    """The loop's rate ratio and longest gap (ms) while `method` copies."""
    alone, _ = loop_rate(rounds, 1.0)
    stop, thread, proc = threading.Event(), None, None
    if method.startswith("thread_"):
        thread = threading.Thread(target=copier, args=(method[7:], stop, path))
        thread.start()
    elif method.startswith("process_"):
        child = [sys.executable, __file__, "--child", method[8:], path]
        proc = subprocess.Popen(child)
        time.sleep(0.5)  # (its state made: the copies under way)
    time.sleep(0.1)
    during, gap = loop_rate(rounds, 1.5)
    stop.set()
    if thread is not None:
        thread.join()
    if proc is not None:
        proc.kill()
        proc.wait()
    return during / alone, gap * 1e3


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        copier(sys.argv[2], threading.Event(), sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rounds = calibrate(1.5)
    found: dict[str, list[tuple[float, float]]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for m in METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]:
                found[m].append(measure(m, rounds, os.path.join(d, "copies")))
    print("| copies made by | rate ratio, median [min-max] | longest gap ms, median |")
    print("|---|---|---|")
    for m, rows in found.items():
        ratios = [x for x, _ in rows]
        print(
            f"| {m} | {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] "
            f"| {statistics.median(g for _, g in rows):.1f} |"
        )


if __name__ == "__main__":
    main()
