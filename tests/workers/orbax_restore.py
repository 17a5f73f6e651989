"""Multi-process worker: restore part of an Orbax checkpoint onto this job's 2 x 4 mesh.

usage: orbax_restore.py CKPT
Reports whether every addressable shard holds the right values, and the read statistics.
"""

from __future__ import annotations

import sys

from _dist import init, report


def main(ckpt: str) -> None:
    init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    from orbax_writer import host_arrays

    h = host_arrays()
    mesh = Mesh(np.array(jax.devices()).reshape(2, -1), ("data", "model"))
    target = {
        "params": {
            "w": jax.ShapeDtypeStruct(
                h["w"].shape, h["w"].dtype, sharding=NamedSharding(mesh, P("data", None))
            ),
            "emb": jax.ShapeDtypeStruct(
                h["emb"].shape, h["emb"].dtype, sharding=NamedSharding(mesh, P(None, "model"))
            ),
        }
    }
    stats = snapshard.ReadStats()
    out = snapshard.load(ckpt, target, stats=stats)
    ok = all(
        np.asarray(shard.data).tobytes() == h[name][shard.index].tobytes()
        for name in ("w", "emb")
        for shard in out["params"][name].addressable_shards
    )
    report(ok=ok, stats=stats.as_dict())


if __name__ == "__main__":
    main(sys.argv[1])
