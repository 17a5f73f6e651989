"""The golden corpus of format 2.x: checkpoints written by the 2.0 library (tests/golden/v2_0,
checksums not bound to their files) and by the 2.1 library (tests/golden/v2_1, checksums
bound to file and offset), both read bit-exactly, verified, and refused cleanly when a file
of one save is put in place of the same-named file of another (written by
tests/golden/make_v2.py; the values by tests/golden/values.py).

The corpus is never written: damage is done to copies in tmp_path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import snapshard
from golden import values
from snapshard.cli import main as cli
from snapshard.errors import ChecksumMismatchError, CorruptCheckpointError
from test_golden_v1 import assert_same, expected, numpy_target

GOLDEN = Path(__file__).parent / "golden"
VERSIONS = {"v2_0": 2, "v2_1": "2.1"}
NAMES = ("single", "compressed", "incremental/step")


@pytest.fixture(scope="module")
def trees() -> dict[str, object]:
    m = values.mesh()
    full = values.single_tree(m)
    return {"single": full, "compressed": full, "incremental/step": values.incremental_tree(m)}


def test_corpus_is_complete_and_small() -> None:
    for version, stated in VERSIONS.items():
        for name in (*NAMES, "incremental/base"):
            doc = json.loads((GOLDEN / version / name / "manifest.json").read_bytes())
            assert doc["version"] == stated, (version, name)
        total = sum(f.stat().st_size for f in (GOLDEN / version).rglob("*") if f.is_file())
        assert total < 256 << 10, (version, total)
    step = json.loads((GOLDEN / "v2_1/incremental/step/manifest.json").read_bytes())
    assert any(r and r["checkpoint"] == "base" for r in step["refs"])
    assert json.loads((GOLDEN / "v2_1/compressed/manifest.json").read_bytes())["codecs"]


@pytest.mark.filterwarnings("ignore::snapshard.tree.ClassesLostWarning")
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", NAMES)
def test_golden_loads_bit_exactly(trees, version: str, name: str) -> None:
    path = GOLDEN / version / name
    assert_same(snapshard.load(path), expected(trees[name], plain=True))
    want = expected(trees[name], plain=False)
    assert_same(snapshard.load(path, numpy_target(trees[name])), want)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", NAMES)
def test_golden_verifies_clean(capsys, version: str, name: str) -> None:
    assert cli(["verify", str(GOLDEN / version / name), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def _swap_data_file(tmp_path: Path, version: str) -> Path:
    """A copy of `single` whose first data file is replaced by the same-numbered data file of
    `incremental/base` (another save of the same tree and options), renamed into place."""
    ckpt = tmp_path / "single"
    shutil.copytree(GOLDEN / version / "single", ckpt)
    mine = sorted((ckpt / "data").iterdir())[0]
    theirs = sorted((GOLDEN / version / "incremental/base/data").iterdir())[0]
    assert mine.name != theirs.name and mine.stat().st_size == theirs.stat().st_size
    if version == "v2_0":  # the very same bytes: nothing tells the saves apart
        assert mine.read_bytes() == theirs.read_bytes()
    shutil.copy(theirs, mine)
    return ckpt


@pytest.mark.filterwarnings("ignore::snapshard.tree.ClassesLostWarning")
def test_a_data_file_of_another_save_is_refused_from_2_1_on(tmp_path, capsys) -> None:
    ckpt = _swap_data_file(tmp_path, "v2_1")
    with pytest.raises(ChecksumMismatchError) as e:
        snapshard.load(ckpt)
    assert ckpt.name in str(e.value) and "data/p00000-" in str(e.value)
    assert cli(["verify", str(ckpt), "--json"]) == 1
    problem = json.loads(capsys.readouterr().out)["problem"]
    assert problem["file"].startswith(str(ckpt)) and problem["leaf"]


@pytest.mark.filterwarnings("ignore::snapshard.tree.ClassesLostWarning")
def test_a_2_0_checkpoint_has_no_binding_to_check(tmp_path) -> None:
    """2.0 stored plain checksums: a same-layout file of another save is indistinguishable
    there (and holds the same bytes here); the 2.1 check above is what closes it."""
    ckpt = _swap_data_file(tmp_path, "v2_0")
    snapshard.load(ckpt)


def test_a_2_1_reference_to_a_2_0_base_is_refused(tmp_path) -> None:
    shutil.copytree(GOLDEN / "v2_1/incremental/step", tmp_path / "step")
    shutil.copytree(GOLDEN / "v2_0/incremental/base", tmp_path / "base")
    with pytest.raises(CorruptCheckpointError, match="'base'"):
        snapshard.load(tmp_path / "step")
