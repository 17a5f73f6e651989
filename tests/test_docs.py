"""The Python blocks of docs/flax.md run, in order, in one fresh process."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def python_blocks(doc: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.S | re.M)


@pytest.mark.slow
def test_flax_guide_runs(tmp_path):
    for mod in ("flax", "optax", "grain"):
        pytest.importorskip(mod)
    blocks = python_blocks(ROOT / "docs" / "flax.md")
    assert len(blocks) >= 8
    script = tmp_path / "flax_guide.py"
    script.write_text("\n\n".join(blocks))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.slow
def test_nnx_train_example_resumes_bit_exact(tmp_path):
    for mod in ("flax", "optax", "grain"):
        pytest.importorskip(mod)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }

    def train(directory, steps, *extra):
        r = subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "nnx_train.py"),
                "--dir",
                str(directory),
                "--steps",
                str(steps),
                "--save-every",
                "3",
                *extra,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert r.returncode == 0, r.stderr[-4000:]
        return r.stdout.strip().splitlines()

    whole = train(tmp_path / "a", 9)[-1]
    train(tmp_path / "b", 4)
    resumed = train(tmp_path / "b", 9)
    assert resumed[0] == "resumed at step 4 on mesh 2x4"
    assert resumed[-1] == whole
    moved = train(tmp_path / "b", 10, "--mesh", "4x2")
    assert moved[0] == "resumed at step 9 on mesh 4x2"
