"""A small sampling profiler for every thread of this process (cProfile sees only one).

Every `interval` seconds it records, for each thread but its own, the innermost frame and
the chain of functions above it. Threads waiting (threading, queue, selectors) are skipped,
so counts show where working threads spend time, including time inside C calls (pread,
memcpy, XLA), which is charged to the Python line that made the call.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter

_IDLE = ("threading.py", "queue.py", "selectors.py", "thread.py")


def _where(frame) -> str:
    code = frame.f_code
    return f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})"


class Sampler:
    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.leaf: Counter[str] = Counter()
        self.inclusive: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            for tid, frame in sys._current_frames().items():
                if tid == me or os.path.basename(frame.f_code.co_filename) in _IDLE:
                    continue
                self.samples += 1
                self.leaf[_where(frame)] += 1
                seen = set()
                f = frame
                while f is not None:
                    base = os.path.basename(f.f_code.co_filename)
                    name = f"{f.f_code.co_name} ({base})"
                    if base not in _IDLE and name not in seen:
                        seen.add(name)
                        self.inclusive[name] += 1
                    f = f.f_back

    def __enter__(self) -> Sampler:
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self.t0

    def report(self, title: str, top: int = 15) -> str:
        n = max(self.samples, 1)
        lines = [f"## {title}: {self.wall:.2f} s, {self.samples} busy-thread samples"]
        lines.append("  innermost frame (self):")
        lines += [f"    {c / n:6.1%}  {k}" for k, c in self.leaf.most_common(top)]
        lines.append("  function on the stack (inclusive):")
        lines += [f"    {c / n:6.1%}  {k}" for k, c in self.inclusive.most_common(top)]
        return "\n".join(lines)
