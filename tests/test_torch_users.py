"""snapshard.torch as users meet it: per-rank state, meta tensors, the mistakes users make
and what each error says, on 2 gloo ranks where several ranks are concerned."""

from __future__ import annotations

import contextlib
import pickle
import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import multiproc  # noqa: E402
import snapshard  # noqa: E402
import snapshard.torch as sst  # noqa: E402
from snapshard import saving  # noqa: E402
from snapshard.errors import (  # noqa: E402
    CheckpointExistsError,
    CheckpointNotFoundError,
    CoordinationError,
    TargetMismatchError,
    UnsupportedLeafError,
)

ENV = {"OMP_NUM_THREADS": "1", "SNAPSHARD_TEST_WITHOUT_JAX": "1"}  # a PyTorch-only install


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The scenarios of workers/torch_users.py, saved on 2 ranks, then loaded on 2 ranks."""
    root = tmp_path_factory.mktemp("users")
    saved = multiproc.run("torch_users.py", 2, 1, "save", root, timeout=240, env=ENV)
    loaded = multiproc.run("torch_users.py", 2, 1, "load", root, timeout=240, env=ENV)
    return root, [p.result() for p in saved], [p.result() for p in loaded]


# ---- several ranks ----------------------------------------------------------------------


def test_a_plain_tensor_that_differs_between_ranks_is_refused_naming_leaf_and_ranks(two_ranks):
    root, saved, _ = two_ranks
    for r in saved:
        got = r["differ"]
        assert "CoordinationError" in got["kinds"], got
        assert "leaf 'rng' has another value on process 1 than on process 0" in got["message"]
        assert "snapshard.PerProcess" in got["message"] and "jax.Arrays" not in got["message"]
    assert not (root / "differ").exists()


def test_the_same_keys_in_another_order_are_refused_saying_so(two_ranks):
    _, saved, _ = two_ranks
    for r in saved:
        assert (
            "process 1 saved the same leaves in another order (leaf 1 is 'c' there, 'b' "
            in (r["order"]["message"])
        ), r["order"]


def test_each_rank_gets_its_own_per_rank_tensor_and_values_back(two_ranks):
    _, _, loaded = two_ranks
    for rank, r in enumerate(loaded):
        assert r["rng"] and r["rng_in_place"], r  # torch.get_rng_state(), into the target's
        assert r["loader"] == {"position": 10 + rank, "epoch": 1}
        assert r["whole_rng"] and r["whole_loader"] == r["loader"]  # without a target too
        assert r["w"] == np.arange(12.0).reshape(6, 2).tolist()
    assert loaded[1]["alone_s"] < 10  # a load without target never waits for other ranks


def test_a_target_refused_on_one_rank_fails_every_rank_at_once_naming_the_leaf(two_ranks):
    _, _, loaded = two_ranks
    for r in loaded:
        got = r["refused"]
        assert got["type"] == "TargetMismatchError", got
        assert "leaf 'w' has shape (6, 2) in the checkpoint" in got["message"], got
        assert got["seconds"] < 10, got  # not the other rank's timeout
        assert got["then"] == [[3.0, 3.0]] * 6
    assert "process 1 failed" in loaded[0]["refused"]["message"]


def test_one_rank_alone_loads_values_without_the_others(two_ranks):
    """A target of values only (no tensor) is one rank's own load: the loads after it stay
    paired (the refusal and the unopened checkpoint below would otherwise time out)."""
    _, _, loaded = two_ranks
    assert loaded[0]["peek"] == {"position": 10, "epoch": 1}


def test_a_checkpoint_one_rank_cannot_open_fails_every_rank_at_once(two_ranks):
    """Access refused on one rank (or the step deleted between the ranks' reads of its
    manifest): every rank raises at once, naming it, and the next load pairs."""
    _, _, loaded = two_ranks
    for r in loaded:
        got = r["unopened"]
        assert "StorageError" in got["kinds"] and "access denied" in got["message"], got
        assert got["seconds"] < 10, got  # not the other rank's timeout
        assert got["then"] == [[3.0, 3.0]] * 6
    assert "process 1 failed" in loaded[0]["unopened"]["message"]


def test_per_rank_values_resplit_onto_one_rank(two_ranks):
    root, _, _ = two_ranks
    with pytest.raises(TargetMismatchError, match=r"leaf '(rng|loader)' .* saved by 2 processes"):
        sst.load(root / "per_rank")
    seen = []

    def first_and_count(leaf, values, rank, world):
        seen.append((leaf, len(values), rank, world))
        return values[0]

    out = sst.load(root / "per_rank", resplit=first_and_count)
    assert out["loader"] == {"position": 10, "epoch": 1}
    torch.manual_seed(100)
    assert torch.equal(out["rng"], torch.get_rng_state())
    assert sorted(seen) == [("loader", 2, 0, 1), ("rng", 2, 0, 1)]


def test_a_meta_tensor_on_one_rank_fails_every_rank_within_seconds(two_ranks):
    _, saved, _ = two_ranks
    for bad in (0, 1):
        for rank, r in enumerate(saved):
            got = r[f"meta{bad}"]
            # the same error type on both ranks, naming the leaf and saying "meta"
            assert got["type"] == "UnsupportedLeafError", got
            assert "leaf 'w'" in got["message"] and "meta device" in got["message"]
            if rank != bad:  # learnt through the rendezvous, not after the 60 s timeout
                assert f"process {bad} failed" in got["message"] or "failed:" in got["message"]
                assert got["seconds"] < 10, got


def test_a_failing_save_async_raises_the_same_type_on_every_rank_logged_once(two_ranks):
    _, saved, _ = two_ranks
    for r in saved:
        got = r["exists"]
        assert got["type"] == "CheckpointExistsError" and "CheckpointExistsError" in got["kinds"]
        assert "a checkpoint already exists at" in got["message"]  # the root cause, on each
        assert len(got["logged"]) == 1, got["logged"]


def test_an_existing_checkpoint_refused_by_one_rank_fails_every_rank_and_the_next_save_works(
    two_ranks,
):
    _, saved, _ = two_ranks
    for r in saved:
        got = r["overwrite"]
        assert got["type"] == "CheckpointExistsError", got
        assert "a checkpoint already exists at" in got["message"]
        assert got["seconds"] < 10, got  # learnt through the rendezvous, not the timeout
        assert got["then"] == [[3.0, 3.0]] * 6


def test_a_manager_step_that_fails_on_one_rank_fails_on_both_and_the_next_commits(two_ranks):
    """The tree of rank 1 holds an object no save takes: rank 1 refuses it before the save's
    blocking phase, rank 0's save of that step fails naming it (not the next step's
    save, paired with it); steps that differ between the ranks are named as such."""
    _, saved, _ = two_ranks
    for r in saved:
        got = r["manager"]
        assert "UnsupportedLeafError" in got["kinds"] or got["type"] == "BackgroundSaveError"
        assert "leaf 'b'" in got["message"], got
        assert "saved to another location at the same time" in got["steps"], got
        assert got["listed"] == [4], got


def test_a_plain_non_empty_directory_is_not_called_a_checkpoint(two_ranks):
    root, saved, _ = two_ranks
    for r in saved:
        assert r["plain"]["type"] == "CheckpointExistsError"
        assert "not a snapshard checkpoint" in r["plain"]["message"]
        assert "already exists" not in r["plain"]["message"]
    assert sorted(p.name for p in (root / "plain").iterdir()) == ["notes.txt"]


def test_a_rank_whose_writes_fail_fails_every_rank_naming_it(two_ranks):
    _, saved, _ = two_ranks
    for bad in (0, 1):
        for r in saved:
            got = r[f"full{bad}"]
            assert f"No space left on device (rank {bad})" in got["message"], got
            assert got["seconds"] < 10, got


def test_failed_saves_leave_no_temporary_directories(two_ranks):
    root, saved, _ = two_ranks
    assert [r["left"] for r in saved] == [[], []]
    assert not list(root.glob("*.snapshard-tmp*"))


def test_info_shows_the_torch_placements(two_ranks, capsys):
    from snapshard.cli import main

    root, _, _ = two_ranks
    assert main(["info", str(root / "per_rank")]) == 0
    text = capsys.readouterr().out
    assert "DTensor(dp=2; S(0))" in text
    assert "per process" in text


# ---- one process --------------------------------------------------------------------------


def test_a_target_on_the_meta_device_is_refused_naming_the_leaf(tmp_path):
    sst.save(tmp_path / "c", {"w": torch.ones(2, 3)})
    with pytest.raises(TargetMismatchError, match=r"target leaf 'w' is on the meta device"):
        sst.load(tmp_path / "c", {"w": torch.empty(2, 3, device="meta")})


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: torch.eye(3).to_sparse(), r"leaf 'w' is a torch.sparse_coo tensor"),
        (lambda: torch.eye(3).to_sparse_csr(), r"leaf 'w' is a torch.sparse_csr tensor"),
        (lambda: torch.ones(3, dtype=torch.complex64).conj(), r"leaf 'w' is a conjugate"),
    ],
)
def test_tensors_whose_bytes_are_not_their_values_are_refused_naming_the_leaf(tmp_path, make, says):
    with pytest.warns() if "csr" in says else contextlib.nullcontext():
        odd = make()
    with pytest.raises(UnsupportedLeafError, match=says):
        sst.save(tmp_path / "c", {"w": odd})
    assert not (tmp_path / "c").exists()
    sst.save(tmp_path / "c", {"w": torch.zeros(odd.shape, dtype=odd.dtype)})
    with pytest.raises(TargetMismatchError, match="target " + says):
        sst.load(tmp_path / "c", {"w": odd})


def test_an_expanded_target_is_refused_rather_than_filled_with_its_last_row(tmp_path):
    sst.save(tmp_path / "c", {"pos": torch.arange(12.0).reshape(3, 4)})
    with pytest.raises(TargetMismatchError, match=r"target leaf 'pos' is an expanded tensor"):
        sst.load(tmp_path / "c", {"pos": torch.zeros(4).expand(3, 4)})


def test_an_empty_container_where_the_checkpoint_has_leaves_names_the_path(tmp_path):
    sst.save(tmp_path / "c", {"data": {"a": torch.ones(2), "b": 3}, "step": 7})
    with pytest.raises(TargetMismatchError, match=r"empty container at 'data', .* 2 leaves"):
        sst.load(tmp_path / "c", {"data": {}, "step": 0})
    with pytest.raises(TargetMismatchError, match=r"target is empty"):
        sst.load(tmp_path / "c", {})
    # A partial restore leaves the entry out instead.
    assert sst.load(tmp_path / "c", {"step": 0}) == {"step": 7}


@pytest.mark.parametrize(
    ("leaf", "says"),
    [
        (torch.float32, r"leaf 'x': a torch.dtype .* str\(value\) = 'torch.float32'"),
        (torch.nn.Linear(2, 2), r"leaf 'x': .*Linear .* module.state_dict\(\)"),
        (torch.device("cpu"), r"leaf 'x': a torch.device .* 'cpu'"),
        (torch.Generator(), r"leaf 'x': .* generator.get_state\(\)"),
    ],
)
def test_torch_objects_that_are_not_state_say_what_to_save(tmp_path, leaf, says):
    with pytest.raises(UnsupportedLeafError, match=says) as e:
        sst.save(tmp_path / "c", {"x": leaf})
    assert "snapshard.torch" not in str(e.value)
    assert not list(tmp_path.iterdir())


def test_per_process_containers_of_tensors_come_back_as_tensors(tmp_path):
    from collections import namedtuple

    Pos = namedtuple("Pos", "epoch offsets")
    value = {"pos": Pos(2, torch.arange(3)), "seen": [torch.ones(2, dtype=torch.bfloat16), 5]}
    sst.save(tmp_path / "c", {"loader": snapshard.PerProcess(value)})
    got = sst.load(tmp_path / "c", {"loader": None})["loader"]
    assert got["pos"][0] == 2 and torch.equal(got["pos"][1], torch.arange(3))
    assert got["seen"][0].dtype == torch.bfloat16 and got["seen"][1] == 5


def test_per_process_messages_name_the_leaf_not_the_class(tmp_path):
    with pytest.raises(UnsupportedLeafError, match=r"leaf 'cursor': a per-process value of type"):
        sst.save(tmp_path / "c", {"cursor": snapshard.PerProcess(object())})
    with pytest.raises(UnsupportedLeafError, match=r"leaf 'rng': the tensor is on the meta"):
        sst.save(tmp_path / "c", {"rng": snapshard.PerProcess(torch.empty(3, device="meta"))})


def test_loading_while_a_save_of_the_directory_runs_says_so(tmp_path, monkeypatch):
    release = threading.Event()
    write_own = saving.files.write_own

    def held(prep):
        release.wait(60)
        return write_own(prep)

    monkeypatch.setattr(saving.files, "write_own", held)
    job = sst.save_async(tmp_path / "c", {"w": torch.ones(4)})
    try:
        with pytest.raises(
            CheckpointNotFoundError,
            match=r"only an incomplete save is there .*: it is still running",
        ):
            sst.load(tmp_path / "c")
    finally:
        release.set()
        job.wait()
    assert torch.equal(sst.load(tmp_path / "c")["w"], torch.ones(4))


def test_a_failed_save_removes_its_temporary_directory(tmp_path, monkeypatch):
    def broken(prep):
        prep.storage.prepare_staging()
        raise OSError(28, "No space left on device")

    # (injected into this process: the background phase runs in its threads)
    monkeypatch.setenv("SNAPSHARD_BACKGROUND", "thread")
    monkeypatch.setattr(saving.files, "write_own", broken)
    with pytest.raises(OSError, match="No space left"):
        sst.save(tmp_path / "c", {"w": torch.ones(4)})
    with pytest.raises(OSError, match="No space left"):
        sst.save_async(tmp_path / "c", {"w": torch.ones(4)}).wait()
    assert list(tmp_path.iterdir()) == []


def test_the_no_target_warning_is_torch_flavoured_and_points_at_the_caller(tmp_path):
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    sst.save(tmp_path / "c", {"pair": Pair(torch.ones(1), 2)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sst.load(tmp_path / "c")
    (w,) = caught
    assert "snapshard.torch.load(path, state_dict)" in str(w.message)
    assert "jax" not in str(w.message) and "nnx" not in str(w.message)
    assert w.filename == __file__


def test_relayed_errors_keep_their_type_and_stay_coordination_errors():
    from snapshard.coordination.rendezvous import relayed_error

    doc = {
        "error": "CheckpointExistsError: a checkpoint already exists",
        "error_type": "CheckpointExistsError",
    }
    e = relayed_error("save to x: process 0 failed", doc)
    assert isinstance(e, CheckpointExistsError) and isinstance(e, CoordinationError)
    assert type(e).__name__ == "CheckpointExistsError"
    assert (
        str(e) == "save to x: process 0 failed: CheckpointExistsError: a checkpoint already exists"
    )
    other = relayed_error("x", {"error": "OSError: boom", "error_type": "OSError"})
    assert type(other) is CoordinationError
    # the base of every snapshard error (a writer process that died): a CoordinationError is one
    base = relayed_error("x", {"error": "SnapshardError: gone", "error_type": "SnapshardError"})
    assert type(base) is CoordinationError
    # pickled (from a writer process, or by a stack's all_gather_object): the same class
    doc["relay"] = {"leaves": ["a"]}
    again = pickle.loads(pickle.dumps(relayed_error("save to x", doc)))
    assert isinstance(again, CheckpointExistsError) and isinstance(again, CoordinationError)
    assert type(again) is type(e) and again.relay == {"leaves": ["a"]}
    assert str(again) == "save to x: CheckpointExistsError: a checkpoint already exists"


def test_snapshard_load_refuses_an_empty_container_too(tmp_path):
    snapshard.save(tmp_path / "c", {"data": {"a": np.ones(2), "b": 3}, "step": 7})
    with pytest.raises(TargetMismatchError, match=r"empty container at 'data', .* 2 leaves"):
        snapshard.load(tmp_path / "c", {"data": {}, "step": 0})
    assert snapshard.load(tmp_path / "c", {"step": 0}) == {"step": 7}
