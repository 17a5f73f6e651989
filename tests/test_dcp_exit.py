"""Resume jobs under torchrun end with exit status 0: a checkpoint saved once, then 20
jobs of 2 ranks (2 at a time) that `dcp.load` it through snapshard.torch.StorageReader
and end normally, through the interpreter's own exit.

A job that leaves its process group to the interpreter's finalization can abort at exit
("terminate called without an active exception"): a gloo worker thread drops the last
collective's tensors after finalization has begun, needs the GIL for them and is ended
inside C++ (torch's, with any storage reader or none). A program ends with
`destroy_process_group()`, as the workers here do; snapshard itself leaves no thread, group
or collective behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch.distributed.checkpoint")

import multiproc

# 21 jobs of 3 processes each, 2 jobs at a time: past the suite's 300 s per test on a
# loaded 2-core machine (each job is bounded by JOB_TIMEOUT_S).
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(900)]
JOBS = 20
AT_ONCE = 2
JOB_TIMEOUT_S = 150


def _torchrun(cmd: str, root: str) -> tuple[int, str]:
    """One job of 2 ranks; its exit status (killed, with its children, at the timeout) and
    its output."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(multiproc.SRC), os.environ.get("PYTHONPATH")])
        ),
    }
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(multiproc.free_port()),
        str(multiproc.WORKERS / "dcp_resume.py"), cmd, root,
    ]  # fmt: skip
    p = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = p.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        out += f"\n[killed after {JOB_TIMEOUT_S} s]"
    return p.returncode, out


def test_resume_jobs_under_torchrun_exit_zero(tmp_path):
    root = str(tmp_path / "ckpt")
    rc, out = _torchrun("save", root)
    assert rc == 0, out[-4000:]
    with ThreadPoolExecutor(AT_ONCE) as pool:
        done = list(pool.map(lambda _: _torchrun("load", root), range(JOBS)))
    failed = [(rc, out) for rc, out in done if rc != 0]
    assert not failed, f"{len(failed)} of {JOBS} jobs failed; the first:\n{failed[0][1][-4000:]}"
    for _, out in done:
        assert "OK 0" in out and "OK 1" in out, out[-4000:]
