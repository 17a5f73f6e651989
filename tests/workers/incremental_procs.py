"""Multi-process worker: incremental managed saves of a sharded tree whose frozen part is
replicated over 'data' and sharded over 'model' (so its boxes have several holders and the
balanced plan may give a box another writer than in the base), under max_to_keep=2.

usage: incremental_procs.py DIR STEPS
"""

from __future__ import annotations

import sys

from _dist import init, report

from snapshard import ReadOptions, SaveOptions


def main() -> None:
    directory, steps = sys.argv[1], int(sys.argv[2])
    pid, _ = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    frozen_sh = NamedSharding(mesh, P(None, "model"))
    train_sh = NamedSharding(mesh, P("data", None))
    full = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    frozen = jax.make_array_from_callback(full.shape, frozen_sh, lambda i: full[i])
    written = []
    with snapshard.CheckpointManager(
        directory,
        max_to_keep=2,
        incremental=True,
        save_options=SaveOptions(timeout_s=60),
        read_options=ReadOptions(timeout_s=60),
    ) as m:
        for step in range(1, steps + 1):
            t = np.full((64, 32), step, np.float32)
            trained = jax.make_array_from_callback(t.shape, train_sh, lambda i, t=t: t[i])
            # a new (equal) frozen array every other step: the hash path, else identity
            f = frozen if step % 2 else jax.jit(lambda a: a + 0, out_shardings=frozen_sh)(frozen)
            m.save(step, {"frozen": f, "trained": trained, "step": step})
            m.wait_until_finished()
            written.append(m.tier_reports()[step].persistent_bytes)
        ok = True
        for s in m.all_steps():
            target = {
                "frozen": jax.ShapeDtypeStruct(full.shape, np.float32, sharding=train_sh),
                "trained": jax.ShapeDtypeStruct((64, 32), np.float32, sharding=frozen_sh),
                "step": 0,
            }
            out = m.restore(s, target)
            ok &= out["step"] == s
            ok &= all(np.array_equal(np.asarray(x.data), full[x.index])
                      for x in out["frozen"].addressable_shards)  # fmt: skip
            ok &= all(np.array_equal(np.asarray(x.data), np.full((64, 32), s)[x.index])
                      for x in out["trained"].addressable_shards)  # fmt: skip
        report(ok=bool(ok), steps=m.all_steps(), written=written, pid=pid)


if __name__ == "__main__":
    main()
