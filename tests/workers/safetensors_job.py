"""Multi-process worker: load safetensors onto a global mesh, stacked experts, export.

usage: safetensors_job.py SHARDED_DIR EXPERTS_FILE EXPORT_PATH
Every process loads the library-written files onto meshes (2, 4) and (8,) spanning all
processes and checks its shards bit-exact; loads the experts stacked and sharded over the
expert axis, recording which tensors' bytes it read; and exports a sharded tree.
"""

from __future__ import annotations

import sys

from _dist import init, report


def main() -> None:
    sharded_dir, experts_file, export_path = sys.argv[1:4]
    pid, _n = init()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard
    import snapshard.safetensors as sst
    from snapshard.safetensors import surgery
    from snapshard.storage import LocalStorage
    from st_files import experts, export_reference, reference

    devs = np.array(jax.devices())
    ok = True

    def check(x, ref):
        want = ref.astype(np.dtype(jax.dtypes.canonicalize_dtype(ref.dtype)))
        return all(
            np.asarray(s.data).tobytes() == want[s.index].tobytes() for s in x.addressable_shards
        )

    # 1. Library-written files with an index onto meshes (2, 4) and (8,), rows sharded.
    ref = reference()
    stats = {}
    for name, m, axis in (
        ("2x4", Mesh(devs.reshape(2, 4), ("data", "model")), ("data", "model")),
        ("8", Mesh(devs, ("x",)), "x"),
    ):
        size = 8
        target = {
            k: jax.ShapeDtypeStruct(
                v.shape,
                v.dtype,
                sharding=NamedSharding(m, P(axis) if v.ndim and v.shape[0] % size == 0 else P()),
            )
            for k, v in ref.items()
        }
        s = snapshard.ReadStats()
        out = sst.load(sharded_dir, target, stats=s)
        ok &= all(check(out[k], v) for k, v in ref.items())
        stats[name] = s.as_dict()
    whole = sst.load(sharded_dir)
    ok &= all(whole[k].tobytes() == v.tobytes() for k, v in ref.items())

    # 2. Stacked experts, sharded over the expert axis: record the bytes each process reads.
    class Recording(LocalStorage):
        def __init__(self, path):
            super().__init__(path)
            self.spans = []

        def read_into(self, name, offset, buffers):
            self.spans.append((offset, sum(len(b) for b in buffers)))
            super().read_into(name, offset, buffers)

    import os

    storage = Recording(os.path.dirname(experts_file))
    stack = surgery.chain(
        surgery.rename(
            r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight", r"l\1.e\2"
        ),
        surgery.stack(r"l(\d+)\.e(?P<i>\d+)", r"layers.\1.w1"),
    )
    src = experts()
    lazy = sst.arrays(storage, stack)
    m = Mesh(devs, ("expert",))
    target = {
        k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m, P("expert")))
        for k, x in lazy.items()
    }
    storage.spans.clear()
    e_stats = snapshard.ReadStats()
    out = sst.load(storage, target, transform=stack, stats=e_stats)
    for layer in range(2):
        want = np.stack(
            [src[f"model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight"] for e in range(8)]
        )
        ok &= check(out[f"layers.{layer}.w1"], want)
    raw = sst.arrays(storage)
    header_end = min(x.offset for x in raw.values())
    read_tensors = sorted(
        {
            name
            for off, n in storage.spans
            if off >= header_end
            for name, x in raw.items()
            if off < x.offset + x.nbytes and x.offset < off + n
        }
    )

    # 3. Export a tree sharded over both processes.
    exp = export_reference()
    m2 = Mesh(devs.reshape(2, 4), ("data", "model"))
    specs = {"w": P("data", "model"), "cols": P(None, "model"), "half": P("model"), "rep": P()}
    tree = {
        k: jax.make_array_from_callback(
            v.shape, NamedSharding(m2, specs[k]), lambda idx, v=v: v[idx]
        )
        for k, v in exp.items()
    }
    res = sst.save(export_path, tree)
    report(
        ok=bool(ok),
        stats=stats,
        experts_stats=e_stats.as_dict(),
        experts_read=read_tensors,
        bytes_written=res.bytes_written,
        process=pid,
    )


if __name__ == "__main__":
    main()
