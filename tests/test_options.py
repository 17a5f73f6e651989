"""SaveOptions and ReadOptions: checked when made, and honoured by every entry point that
takes them (snapshard.save/load, the manager, snapshard.torch)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import snapshard
from snapshard import ReadOptions, ReadStats, SaveOptions


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "fastest"}, "unknown write mode 'fastest'"),
        ({"writers": 0}, "writers must be None or a whole number of at least 1, not 0"),
        ({"writers": True}, "writers must be None or a whole number"),
        ({"writers": 2.0}, "writers must be None or a whole number"),
        ({"compression": "lz4"}, "unknown compression 'lz4'"),
        ({"hashes": 1}, "hashes must be True or False"),
        ({"host_budget": -1}, "host_budget must be None or a whole number of at least 0"),
        ({"timeout_s": 0}, "timeout_s must be a positive number of seconds, not 0"),
    ],
)
def test_bad_save_options_are_refused_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SaveOptions(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"verify": "yes"}, "verify must be True or False"),
        ({"threads": 0}, "threads must be None or a whole number of at least 1, not 0"),
        ({"memory_budget": 0}, "memory_budget must be None or a whole number of at least 1"),
        ({"max_gap": -1}, "max_gap must be None or a whole number of at least 0"),
        ({"read_once": 1}, "read_once must be None, True or False"),
        ({"timeout_s": float("nan")}, "timeout_s must be a positive number of seconds"),
    ],
)
def test_bad_read_options_are_refused_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReadOptions(**kwargs)


def test_options_are_frozen_values():
    a = SaveOptions(compression="zstd")
    assert a == SaveOptions(compression="zstd") and hash(a) == hash(SaveOptions(compression="zstd"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.writers = 3  # type: ignore[misc]
    assert dataclasses.replace(a, writers=3).writers == 3


def test_a_keyword_in_place_of_the_options_object_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match=r"must be a snapshard\.SaveOptions"):
        snapshard.save(tmp_path / "c", {"x": np.zeros(3)}, {"compression": "zstd"})  # type: ignore[arg-type]
    snapshard.save(tmp_path / "c", {"x": np.zeros(3)})
    with pytest.raises(TypeError, match=r"must be a snapshard\.ReadOptions"):
        snapshard.load(tmp_path / "c", None, {"verify": False})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"save_options must be a snapshard\.SaveOptions"):
        snapshard.CheckpointManager(tmp_path / "run", save_options=ReadOptions())  # type: ignore[arg-type]
    torch = pytest.importorskip("torch")
    import snapshard.torch as st

    with pytest.raises(TypeError, match=r"must be a snapshard\.ReadOptions, not dict"):
        st.load(tmp_path / "c", {"x": torch.zeros(3)}, {"verify": False})  # type: ignore[arg-type]


def _data_files(ckpt):
    return sorted(p.name for p in (ckpt / "data").iterdir())


def test_save_honours_writers_and_compression(tmp_path):
    tree = {f"a{i}": np.arange(1 << 16, dtype=np.int64) % 7 for i in range(4)}
    t = snapshard.save(tmp_path / "c", tree, SaveOptions(writers=3, compression="zstd"))
    assert t.data_files == 3 and len(_data_files(tmp_path / "c")) == 3
    assert json.loads((tmp_path / "c" / "manifest.json").read_bytes())["codecs"]
    assert t.bytes_written == sum(v.nbytes for v in tree.values())
    on_disk = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert t.bytes_stored < t.bytes_written / 4 and t.bytes_stored < on_disk
    assert 0 < t.bytes_metadata < t.bytes_stored
    out = snapshard.load(tmp_path / "c")
    assert all(np.array_equal(out[k], v) for k, v in tree.items())


def test_the_manager_writes_every_step_with_its_save_options(tmp_path):
    tree = {"w": np.arange(1 << 16, dtype=np.int64) % 5, "b": np.ones(1 << 15, np.int32)}
    with snapshard.CheckpointManager(
        tmp_path / "run", save_options=SaveOptions(writers=2, compression="zstd")
    ) as m:
        m.save(1, tree)
        m.save(2, tree)
        m.wait_until_finished()
        timings = m.save_timings()
    for step in (1, 2):
        assert timings[step].data_files == 2
        assert json.loads((tmp_path / "run" / str(step) / "manifest.json").read_bytes())["codecs"]


def test_the_manager_restores_with_its_read_options_unless_given_others(tmp_path, monkeypatch):
    import snapshard.reading.sources as sources

    seen: list[tuple[bool, int]] = []
    real = sources.reader_of

    def spy(storage, manifest, finder, options, stats):
        seen.append((options.verify, options.threads))
        return real(storage, manifest, finder, options, stats)

    monkeypatch.setattr(sources, "reader_of", spy)
    tree = {"w": np.arange(1000, dtype=np.float32)}
    with snapshard.CheckpointManager(
        tmp_path / "run", read_options=ReadOptions(verify=False, threads=2)
    ) as m:
        m.save(1, tree)
        m.wait_until_finished()
        stats = ReadStats()
        out = m.restore(1, stats=stats)
        assert seen[-1] == (False, 2) and stats.bytes_read >= 4000
        m.restore(1, None, ReadOptions(threads=3))
        assert seen[-1] == (True, 3)
    assert np.array_equal(out["w"], tree["w"])


def test_torch_takes_the_same_options(tmp_path):
    torch = pytest.importorskip("torch")
    import snapshard.torch as st

    sd = {"w": torch.arange(1 << 16, dtype=torch.int64) % 9, "b": torch.ones(99), "step": 3}
    t = st.save(tmp_path / "c", sd, SaveOptions(writers=2, compression="zstd"))
    assert t.data_files == 2 and t.bytes_stored < t.bytes_written / 4
    target = {"w": torch.zeros(1 << 16, dtype=torch.int64), "b": torch.zeros(99), "step": 0}
    stats = ReadStats()
    out = st.load(tmp_path / "c", target, ReadOptions(verify=False, threads=1), stats=stats)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    assert out["step"] == 3 and stats.bytes_read > 0
