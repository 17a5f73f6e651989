"""The part of a restore that is not file I/O: jax.device_put of the host tree into the target
sharding, on 8 CPU devices. Save layout (data=2, model=4) P(None, 'model') holds 2 copies of
every weight; the reshard layout (data=4, model=2) P('model', None) holds 4.

usage: python job_floor.py [--scale S] [--round R] [--reps N]
"""

from __future__ import annotations

import argparse

import common as bc

bc.force_cpu_devices(8)

import jax  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    spec = bc.tree_spec(args.scale)
    host = {k: bc.make_array(k, args.scale) for k in spec}
    layouts = {
        "floor_device_put_same": (bc.mesh(2, 4), False),
        "floor_device_put_reshard": (bc.mesh(4, 2), True),
    }

    def shardings(m, reshard):
        return {k: bc.sharding_for(kind, m, reshard) for k, (_, _, kind) in spec.items()}

    for m, reshard in layouts.values():  # warm-up: first transfers set up XLA's paths
        sh = shardings(m, reshard)
        small = {k: host[k] for k in bc.WARMUP_LEAVES}
        bc.delete_tree(jax.block_until_ready(jax.device_put(small, {k: sh[k] for k in small})))
    items = list(layouts.items())
    if args.round % 2:
        items.reverse()
    for rep in range(args.reps):
        for name, (m, reshard) in items:
            sh = shardings(m, reshard)
            with bc.Meter() as meter:
                out = jax.block_until_ready(jax.device_put(host, sh))
            dev_bytes = sum(s.data.nbytes for a in out.values() for s in a.addressable_shards)
            bc.emit(method=name, rep=rep, device_bytes=dev_bytes, **meter.as_dict("op"))
            bc.delete_tree(out)
            del out


if __name__ == "__main__":
    main()
