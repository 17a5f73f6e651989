"""Staging directories of killed saves: removed by the next save into the same parent when
their writers are provably gone (never a live writer's), listed by `snapshard ls`, removed
by `snapshard clean` (a dry run by default). Killed saves are real processes that exit in
the middle of a save."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import snapshard
from snapshard.cli import main
from snapshard.storage import local, owner_records, stale_staging
from snapshard.storage.owner_records import ALIVE, GONE, UNKNOWN

WORKER = Path(__file__).parent / "workers" / "stale_writer.py"
SRC = Path(__file__).parent.parent / "src"


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }


def killed_save(mode: str, path: Path) -> Path:
    """Run a save of `mode` to `path` that exits in the middle; its staging directory."""
    r = subprocess.run(
        [sys.executable, str(WORKER), mode, str(path)],
        env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    (staging,) = local.LocalStorage(path).staging_dirs()
    return staging


class Holder:
    """A live process that stages for `path` under `token` until stopped."""

    def __init__(self, path: Path, token: str):
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "hold", str(path), token],
            env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "READY", line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=30)


@pytest.fixture
def holders():
    started: list[Holder] = []
    yield lambda path, token: started.append(Holder(path, token)) or started[-1]
    for h in started:
        h.stop()


def save_beside(parent: Path, name: str = "next") -> None:
    snapshard.save(parent / name, {"x": np.arange(4.0)})
    assert stale_staging.wait_for_removals(30)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if "snapshard" in p.name)


# ---- judging an owner --------------------------------------------------------------------


def test_an_owner_is_alive_while_its_process_runs_and_gone_after(tmp_path):
    me = owner_records.this_process()
    assert owner_records.judge(me).state == ALIVE
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        start = owner_records._process_stat(child.pid)
        assert start is not None
        theirs = dataclasses.replace(me, pid=child.pid, start=start[1])
        assert owner_records.judge(theirs).state == ALIVE
        reused = dataclasses.replace(theirs, start=start[1] + 1)  # the pid, another process
        verdict = owner_records.judge(reused)
        assert verdict.state == GONE and "newer process" in verdict.why
    finally:
        child.communicate(b"", timeout=30)
    assert owner_records.judge(theirs).state == GONE


def test_owners_on_other_hosts_or_namespaces_are_unknown_and_a_reboot_is_gone():
    me = owner_records.this_process()
    other_host = owner_records.judge(dataclasses.replace(me, host=me.host + "-elsewhere"))
    assert other_host.state == UNKNOWN and "another host" in other_host.why
    if me.boot is None:
        pytest.skip("no boot id on this system")
    rebooted = owner_records.judge(dataclasses.replace(me, boot="0" * 36))
    assert rebooted.state == GONE and "rebooted" in rebooted.why
    container = owner_records.judge(dataclasses.replace(me, pidns="pid:[1]"))
    assert container.state == UNKNOWN and "namespace" in container.why


def test_the_record_is_written_once_per_process_and_read_back(tmp_path):
    owner_records.ensure_owner_record(tmp_path)
    owner_records.ensure_owner_record(tmp_path)
    (record,) = tmp_path.iterdir()
    assert owner_records.is_owner_record(record.name)
    found = stale_staging.inspect(tmp_path, "ckpt", "staging")
    assert [o.identity for o in found.owners] == [owner_records.this_process()]
    assert found.state == ALIVE
    record.write_text("{not json")  # a writer killed while writing it: cannot be judged
    assert stale_staging.inspect(tmp_path, "ckpt", "staging").state == UNKNOWN


# ---- the next save removes what killed saves left -----------------------------------------


@pytest.mark.parametrize("mode", ["kill-numpy", "kill-torch", "kill-dcp"])
def test_the_next_save_into_the_parent_removes_a_killed_saves_staging(tmp_path, mode):
    if mode != "kill-numpy":
        pytest.importorskip("torch")
    staging = killed_save(mode, tmp_path / "step_2")
    records = [p for p in staging.iterdir() if owner_records.is_owner_record(p.name)]
    assert staging.is_dir() and records
    (u,) = stale_staging.find(tmp_path)
    assert u.state == GONE and u.checkpoint == "step_2"
    save_beside(tmp_path, "step_4")
    assert leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]
    # a committed checkpoint carries no owner record
    committed = sorted(p.name for p in (tmp_path / "step_4").iterdir())
    assert committed == ["data", "index", "manifest.json"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_dcp_writer_removes_it_too(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    import snapshard.torch as sst

    killed_save("kill-numpy", tmp_path / "last.ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=sst.StorageWriter(tmp_path / "other"))
    assert stale_staging.wait_for_removals(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_a_live_writers_staging_is_never_removed(tmp_path, holders):
    holder = holders(tmp_path / "step_3", "livejob-1")
    save_beside(tmp_path)
    assert leftovers(tmp_path) == ["step_3.snapshard-tmp-livejob-1"]
    holder.stop()
    save_beside(tmp_path, "again")
    assert leftovers(tmp_path) == []


def test_the_job_owns_the_directory_every_process_must_be_gone(tmp_path, holders):
    """Two processes of one job write into one staging directory: one of them dying does
    not make it stale; both gone does."""
    first = holders(tmp_path / "step_5", "job-1")
    second = holders(tmp_path / "step_5", "job-1")
    (u,) = stale_staging.find(tmp_path)
    assert len(u.owners) == 2 and u.state == ALIVE
    first.stop()
    save_beside(tmp_path)
    (u,) = stale_staging.find(tmp_path)
    assert sorted(o.state for o in u.owners) == [ALIVE, GONE] and u.state == ALIVE
    second.stop()
    save_beside(tmp_path, "again")
    assert leftovers(tmp_path) == []


def test_a_staging_directory_without_owner_record_stays(tmp_path):
    old = tmp_path / ("7" + stale_staging.STAGING_SUFFIX) / "data"  # an older version's save
    old.mkdir(parents=True)
    save_beside(tmp_path)
    (u,) = stale_staging.find(tmp_path)
    assert u.state == UNKNOWN and "no owner recorded" in u.why


def test_a_writer_that_records_itself_during_the_removal_gets_its_directory_back(tmp_path):
    staging = killed_save("kill-numpy", tmp_path / "ckpt")
    (u,) = stale_staging.find(tmp_path)
    assert u.state == GONE
    owner_records.ensure_owner_record(staging)  # a live writer arrives after the judgement
    assert stale_staging.set_aside(u) is None
    assert staging.is_dir() and leftovers(tmp_path) == [staging.name]


def test_an_interrupted_removal_is_finished_by_the_next_sweep(tmp_path):
    killed_save("kill-numpy", tmp_path / "ckpt")
    (u,) = stale_staging.find(tmp_path)
    trash = stale_staging.set_aside(u)  # renamed aside, then the sweeper died
    assert trash is not None and trash.is_dir() and stale_staging.STAGING_SUFFIX not in trash.name
    (t,) = stale_staging.find(tmp_path)
    assert t.kind == "trash" and t.state == GONE
    for record in [p for p in trash.iterdir() if owner_records.is_owner_record(p.name)]:
        record.unlink()  # even with its records already deleted
    assert stale_staging.find(tmp_path)[0].state == GONE
    save_beside(tmp_path)
    assert leftovers(tmp_path) == []


def test_a_failed_save_in_a_live_process_leaves_nothing_of_its_own(tmp_path):
    storage = local.LocalStorage(tmp_path / "ckpt")
    storage.set_attempt("job-1")
    storage.prepare_staging()
    storage.discard_staging_if_empty()  # what a failed save's clean-up calls
    assert leftovers(tmp_path) == []


# ---- the command line -------------------------------------------------------------------


def run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().out


def test_ls_shows_unfinished_saves_with_writers_state_and_size(tmp_path, capsys, holders):
    snapshard.save(tmp_path / "1", {"x": np.arange(3.0)})
    holders(tmp_path / "3", "live-1")  # (first: a save beside a stale one removes it)
    staging = killed_save("kill-numpy", tmp_path / "2")
    code, out = run(capsys, "ls", tmp_path, "--json")
    assert code == 0
    entries = {e["name"]: e for e in json.loads(out)["checkpoints"]}
    (gone,) = entries["2"]["unfinished"]
    assert gone["name"] == staging.name and gone["state"] == GONE and gone["bytes"] > 0
    assert gone["owners"][0]["state"] == GONE and gone["owners"][0]["pid"] > 0
    assert entries["3"]["unfinished"][0]["state"] == ALIVE
    assert "unfinished" not in entries["1"]
    code, out = run(capsys, "ls", tmp_path)
    assert "UNFINISHED SAVES" in out and f"{staging.name} (writers gone: pid" in out
    assert f"snapshard clean {tmp_path}" in out.splitlines()[-1]


def test_clean_is_a_dry_run_unless_told_and_never_touches_a_live_writer(tmp_path, capsys, holders):
    holders(tmp_path / "3", "live-1")
    gone = killed_save("kill-numpy", tmp_path / "2")
    unknown = tmp_path / ("4" + stale_staging.STAGING_SUFFIX)
    unknown.mkdir()
    before = leftovers(tmp_path)
    code, out = run(capsys, "clean", tmp_path)
    assert code == 0 and "dry run: would remove 1" in out and leftovers(tmp_path) == before
    doc = json.loads(run(capsys, "clean", tmp_path, "--json")[1])
    actions = {e["name"]: (e["action"], e["state"]) for e in doc["entries"]}
    assert actions == {
        gone.name: ("remove", GONE),
        "3.snapshard-tmp-live-1": ("keep", ALIVE),
        unknown.name: ("keep", UNKNOWN),
    }
    assert doc["dry_run"] and leftovers(tmp_path) == before
    code, out = run(capsys, "clean", tmp_path, "--yes")
    assert code == 0 and "removed 1 of 1" in out
    assert leftovers(tmp_path) == sorted(["3.snapshard-tmp-live-1", unknown.name])
    code, out = run(capsys, "clean", tmp_path, "--yes", "--unknown")
    assert code == 0 and leftovers(tmp_path) == ["3.snapshard-tmp-live-1"]


def test_clean_of_a_checkpoint_or_a_missing_directory_is_bad_input(tmp_path, capsys):
    snapshard.save(tmp_path / "ckpt", {"x": np.arange(2.0)})
    code = main(["clean", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert code == 2 and f"snapshard clean {tmp_path}" in err
    assert main(["clean", str(tmp_path / "nothing")]) == 2
    code, out = run(capsys, "clean", tmp_path)
    assert code == 0 and "nothing left by unfinished saves" in out
