"""Multi-process worker: Grain iterators as leaves, each process with its own position.

usage: iterators.py MODE DIR
   save      each process advances its own DataLoader iterator (over its shard) and its own
             dataset iterator by a different number of steps, and the job saves them beside a
             sharded array with the CheckpointManager (step 5); reports the elements the
             iterators yield next
   restore   a fresh job restores into fresh iterators; reports what they yield next
   count     (another process count) restores without `resplit`: reports the error
   resplit   (another process count) restores the dataset iterator with a `resplit` that
             turns the saved positions into this process's, and the DataLoader with one that
             hands it another process's position (which Grain refuses)
"""

from __future__ import annotations

import sys

from _dist import init, report

from snapshard import ReadOptions, SaveOptions

RECORDS, STEP = 48, 5
TAKE = 3


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    pid, n = init()
    import grain
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    def loader() -> grain.DataLoader:
        sampler = grain.samplers.IndexSampler(
            num_records=RECORDS,
            shard_options=grain.sharding.ShardOptions(
                shard_index=pid, shard_count=n, drop_remainder=True
            ),
            shuffle=True,
            seed=11,
            num_epochs=None,
        )
        return grain.DataLoader(
            data_source=grain.sources.RangeDataSource(0, RECORDS, 1),
            sampler=sampler,
            operations=[grain.transforms.Batch(batch_size=2)],
            worker_count=0,
        )

    def stream():  # this process's records, in order: pid, pid + n, pid + 2n, ...
        return iter(grain.MapDataset.range(RECORDS)[pid::n].to_iter_dataset())

    def take(it) -> list:
        return [np.asarray(next(it)).tolist() for _ in range(TAKE)]

    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    size = 4 * len(jax.devices())
    w_target = jax.ShapeDtypeStruct((size,), np.float32, sharding=sharding)

    def target() -> dict:
        return {"loader": iter(loader()), "stream": stream(), "w": w_target, "step": 0}

    manager = snapshard.CheckpointManager(
        directory, save_options=SaveOptions(timeout_s=60), read_options=ReadOptions(timeout_s=60)
    )
    if mode == "save":
        tree = target()
        for _ in range(2 + 3 * pid):  # process 0: 2 batches, process 1: 5
            next(tree["loader"])
        for _ in range(1 + 4 * pid):  # process 0: 1 record, process 1: 5
            next(tree["stream"])
        tree["w"] = jax.make_array_from_callback(
            (size,), sharding, lambda index: np.arange(size, dtype=np.float32)[index]
        )
        tree["step"] = STEP
        manager.save(STEP, tree, force=True)
        manager.wait_until_finished()
        manager.close()
        # What the uninterrupted iterators yield after the save.
        report(loader=take(tree["loader"]), stream=take(tree["stream"]))
        return
    if mode == "restore":
        fresh = target()
        out = manager.restore(STEP, target=fresh)
        manager.close()
        report(
            same_objects=out["loader"] is fresh["loader"] and out["stream"] is fresh["stream"],
            loader=take(out["loader"]),
            stream=take(out["stream"]),
            w_ok=all(
                np.array_equal(np.asarray(s.data), np.arange(size, dtype=np.float32)[s.index])
                for s in out["w"].addressable_shards
            ),
            step=out["step"],
        )
        return
    if mode == "count":
        try:
            manager.restore(STEP, target=target())
        except snapshard.SnapshardError as e:
            report(error=type(e).__name__, message=str(e))
        else:
            report(error=None)
        manager.close()
        return
    assert mode == "resplit", mode
    saved_count = int(sys.argv[3])

    def resume_stream(name, records, me, count):
        # Saved process q had read records q, q + saved_count, ... up to its position; every
        # record below saved_count * (the smallest position) was read by some process.
        assert name == "stream", name
        done = saved_count * min(r["state"]["next_index"] for r in records)
        # This process reads records me, me + count, ...: resume at the first one not done.
        return {"iterator": "tree", "state": {"next_index": -(-(done - me) // count)}}

    def other_loader(name, records, me, count):
        return records[(me + 1) % len(records)]

    fresh = {"stream": stream(), "w": w_target}
    out = manager.restore(STEP, target=fresh, resplit=resume_stream)
    result: dict = {
        "stream": take(out["stream"]),
        "w": np.asarray(jax.device_get(out["w"])).tolist(),
    }
    try:
        manager.restore(STEP, target={"loader": iter(loader())}, resplit=other_loader)
    except snapshard.SnapshardError as e:
        result.update(error=type(e).__name__, message=str(e))
    manager.close()
    report(**result)


if __name__ == "__main__":
    main()
