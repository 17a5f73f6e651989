"""Start several real processes joined by jax.distributed (CPU backend, gloo collectives).

Each worker is a script in tests/workers/ run as `python worker.py ARGS...` with the
process layout in its environment; it calls `workers._dist.init()` first and reports
results as lines `RESULT <json>` on stdout. Every run is bounded in time, and all processes
it started are killed (with their process groups) when it ends, however it ends.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
SRC = Path(__file__).parent.parent / "src"
GLOO_EXIT_ABORT = "terminate called without an active exception"


def free_port() -> int:
    """A port free now, chosen below the kernel's ephemeral range: a port the kernel handed
    out (bind to port 0) may be given again to any outgoing connection, a client of the
    object-store servers say, before the coordinator binds it ("Failed to add port")."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.SystemRandom()  # not the tests' seeded `random`: workers pick at once
    for _ in range(200):
        port = pick.randrange(20000, max(low, 20001))
        if _bindable(socket.AF_INET, "127.0.0.1", port) and _bindable(socket.AF_INET6, "::", port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(family: socket.AddressFamily, host: str, port: int) -> bool:
    """Nothing holds `port` (where the family exists at all: some sandboxes have no IPv6)."""
    try:
        with socket.socket(family) as s:
            s.bind((host, port))
    except OSError as e:
        return e.errno not in (errno.EADDRINUSE, errno.EACCES)
    return True


@dataclass
class Proc:
    process_id: int
    returncode: int | None
    stdout: str
    stderr: str
    results: list[dict] = field(default_factory=list)

    def exited_well(self) -> bool:
        """Exit 0, or torch 2.13 gloo's abort at interpreter exit once the work is done: its
        worker thread frees the last collective's tensors while Python shuts down (SIGABRT,
        "terminate called without an active exception", no Python traceback; see
        test_dcp_exit.py), after the process reported its results."""
        if self.returncode == 0:
            return True
        return (
            self.returncode == -signal.SIGABRT
            and bool(self.results)
            and GLOO_EXIT_ABORT in self.stderr
            and "Traceback" not in self.stderr
        )

    def result(self) -> dict:
        assert self.results, f"process {self.process_id} reported nothing:\n{self.stderr[-3000:]}"
        return self.results[-1]


def _env(pid: int, n: int, devices: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "SNAPSHARD_TEST_PORT": str(port),
            "SNAPSHARD_TEST_PROCESS_ID": str(pid),
            "SNAPSHARD_TEST_NUM_PROCESSES": str(n),
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
            "JAX_PLATFORMS": "cpu",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(SRC), str(WORKERS.parent), env.get("PYTHONPATH", "")])
            ),
        }
    )
    env.update(extra or {})
    return env


def start(
    worker: str,
    n: int,
    devices: int,
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> list[subprocess.Popen]:
    port = port or free_port()
    procs = []
    for pid in range(n):
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKERS / worker), *map(str, args)],
                env=_env(pid, n, devices, port, env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def collect(procs: list[subprocess.Popen], timeout: float) -> list[Proc]:
    """Wait for every process (killing all of them at the deadline) and parse their output."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for pid, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_all(procs)
                stdout, stderr = p.communicate()
                stderr += f"\n[killed: the run exceeded {timeout} s]"
            results = [
                json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")
            ]
            out.append(Proc(pid, p.returncode, stdout, stderr, results))
            if _port_taken(out[-1]):  # (the others would wait for a coordinator that is not)
                kill_all(procs)
    finally:
        kill_all(procs)
    return out


def _port_taken(p: Proc) -> bool:
    """The process failed before reporting anything because its port was taken."""
    return (
        p.returncode not in (0, None)
        and not p.results
        and any(
            s in p.stderr for s in ("EADDRINUSE", "Failed to add port", "address already in use")
        )
    )


def run(
    worker: str,
    n: int,
    devices: int,
    *args: object,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[Proc]:
    """Run `worker` as n processes of `devices` CPU devices each; all must exit 0 when check.
    A run whose coordinator found its port taken (another program bound it between the
    choice and the bind) starts again on another port, up to twice."""
    for attempt in range(3):
        procs = start(worker, n, devices, [str(a) for a in args], env=env)
        done = collect(procs, timeout)
        if attempt == 2 or not any(_port_taken(p) for p in done):
            break
    if check:
        for p in done:
            assert p.exited_well(), (
                f"process {p.process_id} exited {p.returncode}:\n{p.stderr[-4000:]}"
            )
    return done
