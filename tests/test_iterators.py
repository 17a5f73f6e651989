"""Data iterators (Grain) as checkpoint records, and bytes leaves."""

import json

import numpy as np
import pytest

import snapshard
from snapshard.errors import SnapshardError, UnsupportedLeafError
from snapshard.iterators import (
    is_checkpointable_iterator,
    iterator_record,
    restore_iterator,
    state_of_record,
)

grain = pytest.importorskip("grain")


def loader(shard_index=0, shard_count=1):
    sampler = grain.samplers.IndexSampler(
        num_records=40,
        shard_options=grain.sharding.ShardOptions(
            shard_index=shard_index, shard_count=shard_count, drop_remainder=True
        ),
        shuffle=True,
        seed=3,
        num_epochs=2,
    )
    return grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 40, 1),
        sampler=sampler,
        operations=[grain.transforms.Batch(batch_size=4)],
        worker_count=0,
    )


def dataset():
    return grain.MapDataset.range(30).shuffle(seed=5).map(lambda x: x * 3).batch(3)


def take(it, n):
    return [np.asarray(next(it)).tolist() for _ in range(n)]


@pytest.mark.parametrize("kind", ["data_loader", "dataset"])
def test_iterator_resumes_from_a_saved_record(ckpt, kind):
    make = (
        (lambda: iter(loader()))
        if kind == "data_loader"
        else (lambda: iter(dataset().to_iter_dataset()))
    )
    it = make()
    assert is_checkpointable_iterator(it)
    take(it, 3)
    record = iterator_record(it, leaf="data")
    assert record["iterator"] == ("json_bytes" if kind == "data_loader" else "tree")
    snapshard.save(ckpt, {"data": record, "step": 3})
    expected = take(it, 4)
    restored = snapshard.load(ckpt)["data"]
    fresh = restore_iterator(make(), restored, leaf="data")
    assert take(fresh, 4) == expected


def test_each_shard_keeps_its_own_position(tmp_path):
    # what each process of a job would save: its own shard's iterator
    records, expected = [], []
    for shard in range(2):
        it = iter(loader(shard, 2))
        take(it, shard + 1)
        records.append(iterator_record(it))
        expected.append(take(it, 2))
    for shard in range(2):
        snapshard.save(tmp_path / str(shard), {"data": records[shard]})
    for shard in range(2):
        it = restore_iterator(iter(loader(shard, 2)), snapshard.load(tmp_path / str(shard))["data"])
        assert take(it, 2) == expected[shard]
    assert expected[0] != expected[1]


def test_an_iterator_that_refuses_the_saved_position_names_the_leaf():
    it = iter(loader(1, 2))
    next(it)
    record = iterator_record(it)
    # Grain checks the sampler (here: another shard) of the state against the loader's.
    with pytest.raises(snapshard.TargetMismatchError, match=r"leaf 'data': .*refused.*Sampler"):
        restore_iterator(iter(loader(0, 2)), record, leaf="data")
    assert take(restore_iterator(iter(loader(1, 2)), record), 1) == take(it, 1)


class OwnIterator:
    def __init__(self, state):
        self.state = state

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


def test_records_of_other_states():
    assert iterator_record(OwnIterator({"pos": 3, "names": ["a", None]})) == {
        "iterator": "tree",
        "state": {"pos": 3, "names": ["a", None]},
    }
    raw = iterator_record(OwnIterator(b"\x00\xff binary"))
    assert raw == {"iterator": "bytes", "state": b"\x00\xff binary"}
    assert state_of_record(raw) == b"\x00\xff binary"
    with pytest.raises(UnsupportedLeafError, match=r"it/pos: iterator state holds a ndarray"):
        iterator_record(OwnIterator({"pos": np.zeros(2)}), leaf="it")
    with pytest.raises(SnapshardError, match="not an iterator record"):
        state_of_record({"state": 1})
    assert not is_checkpointable_iterator({"get_state": 1})
    assert not is_checkpointable_iterator(np.zeros(2))


# ---- bytes leaves ----------------------------------------------------------------------
#
# The manifest stores a bytes value as {"type": "bytes", "value": <base64>}
# (format.values.encode_value / decode_value; saving.save_array.VALUE_TYPES has bytes).


def test_bytes_leaves(ckpt):
    it = OwnIterator(b"\x00\x01\xfe\xff" * 10)
    snapshard.save(ckpt, {"data": iterator_record(it), "blob": b"", "raw": bytes(range(256))})
    out = snapshard.load(ckpt)
    assert out["blob"] == b"" and out["raw"] == bytes(range(256))
    assert restore_iterator(OwnIterator(None), out["data"]).state == it.state


class OwnStream(OwnIterator):
    def __next__(self):
        return self.state


def test_an_iterator_leaf_is_saved_per_process_and_restored_into_the_target(ckpt):
    it = iter(loader())
    next(it)
    snapshard.save(ckpt, {"data": it, "step": 1, "own": OwnStream({"pos": 7})})
    expected = next(it)
    doc = json.loads((ckpt / "manifest.json").read_bytes())
    kinds = {tuple(leaf["path"]): leaf["kind"] for leaf in doc["leaves"]}
    assert kinds[("data",)] == kinds[("own",)] == "per_process"
    fresh, own = iter(loader()), OwnStream(None)
    out = snapshard.load(ckpt, {"data": fresh, "step": 0, "own": own})
    assert out["data"] is fresh and (next(out["data"]) == expected).all()
    assert out["own"] is own and own.state == {"pos": 7}
    # Without a target: the record, as each process saved it.
    assert snapshard.load(ckpt)["own"] == {"iterator": "tree", "state": {"pos": 7}}
