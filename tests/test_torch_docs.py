"""The examples of docs/torch.md marked `<!-- tested: NAME -->` run as they are written: on
every rank of a 2-rank gloo job (where JAX cannot be imported), and in one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import multiproc

ROOT = Path(__file__).parent.parent
ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}


def doc_block(name: str) -> str:
    text = (ROOT / "docs" / "torch.md").read_text()
    found = re.findall(rf"^<!-- tested: {name} -->\n```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(found) == 1, f"docs/torch.md has {len(found)} blocks marked {name!r}"
    return found[0]


@pytest.mark.multiprocess
def test_the_per_rank_state_example_runs_on_2_ranks(tmp_path):
    script = tmp_path / "per_rank.py"
    script.write_text(doc_block("per-rank"))
    work = tmp_path / "job"
    work.mkdir()
    done = multiproc.run("torch_docs.py", 2, 1, script, work, timeout=180, env=ENV)
    assert [p.result()["done"] for p in done] == [True, True]
    assert sorted(p.name for p in (work / "ckpt" / "run").iterdir()) == ["1", "2"]


def test_the_per_rank_state_example_runs_in_one_process(tmp_path):
    script = tmp_path / "per_rank.py"
    script.write_text(doc_block("per-rank"))
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.multiprocess
def test_the_pipeline_stages_example_runs_on_2_ranks(tmp_path):
    script = tmp_path / "pipeline.py"
    script.write_text(doc_block("pipeline"))
    work = tmp_path / "job"
    work.mkdir()
    done = multiproc.run("torch_docs.py", 2, 1, script, work, timeout=180, env=ENV)
    assert [p.result()["done"] for p in done] == [True, True]


def test_the_pipeline_stages_example_runs_in_one_process(tmp_path):
    script = tmp_path / "pipeline.py"
    script.write_text(doc_block("pipeline"))
    r = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
