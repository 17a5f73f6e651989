"""Orbax's CheckpointManager with its own StandardCheckpointHandler next to the same manager
with snapshard.orbax.Handler: one state, one process, 8 CPU devices, side by side per round.

Per round and handler (the order alternates between rounds): a fresh directory, `os.sync()`,
then `mgr.save(0, ...)` (blocking: until it returns), `wait_until_finished()` (total: until
the step is committed; both durable, TensorStore and snapshard fsync what they write), and a
restore into the save sharding from the page cache ("restore") and onto the reshard mesh
("reshard"), checked bit for bit. Both managers are asynchronous (Orbax's default). Ratios
are Orbax's time over snapshard's, paired per round, then the median. Each round also
writes the state's byte count raw into one fsync'd file: the disk's floor for a save.

usage: python bench/bench_orbax_handler.py [--rounds 3] [--scale 0.125] [--out FILE.jsonl]
The state is bench/common.py's (2 GiB at scale 1; 267 MiB at the default 0.125).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import warnings

import common as bc

bc.force_cpu_devices(8)

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import snapshard.orbax  # noqa: E402

warnings.filterwarnings("ignore")
METHODS = ("orbax", "snapshard")
_PIECE = 64 << 20
STEPS = ("blocking", "save", "restore", "reshard")


def manager(method: str, path: str):
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=True)
    if method == "orbax":
        return ocp.CheckpointManager(path, options=opts, item_names=("state",))
    handler = snapshard.orbax.Handler()
    return ocp.CheckpointManager(
        path, options=opts, item_names=("state",), item_handlers={"state": handler}
    )


def args_for(method: str, tree, restore: bool):
    if method == "orbax":
        item = ocp.args.StandardRestore(tree) if restore else ocp.args.StandardSave(tree)
    else:
        item = snapshard.orbax.Restore(tree) if restore else snapshard.orbax.Save(tree)
    return ocp.args.Composite(state=item)


def run(method: str, tree, scale: float, path: str) -> dict:
    """One save and two restores of `tree` through `method`'s handler; times in seconds."""
    bc.fresh_dir(path)
    bc.settle()
    res: dict = {"method": method}
    mgr = manager(method, path)
    try:
        with bc.Meter() as total:
            with bc.Meter() as blk:
                mgr.save(0, args=args_for(method, tree, False))
            mgr.wait_until_finished()
        res["blocking"], res["save"] = blk.wall, total.wall
        # where a save's time goes: this process's CPU, and the machine's iowait meanwhile
        res["save_cpu"], res["save_iowait"] = total.cpu, total.iowait
        save_mesh, reshard_mesh = bc.mesh(2, 4), bc.mesh(4, 2)
        ok = True
        for step, m, reshard in (("restore", save_mesh, False), ("reshard", reshard_mesh, True)):
            target = bc.abstract(tree, scale, m, reshard)
            with bc.Meter() as meter:
                out = mgr.restore(0, args=args_for(method, target, True))["state"]
                jax.block_until_ready(out)
            res[step] = meter.wall
            ok &= bc.check_restored(bc.flatten(out), scale)
            bc.delete_tree(out)
        res["bit_exact"] = ok
    finally:
        mgr.close()
        bc.remove(path)
    return res


def raw_write(path: str, nbytes: int) -> float:
    """The disk's floor in the same round: the state's byte count written from one buffer
    into one file and fsync'd (file and directory), in seconds."""
    bc.fresh_dir(path)
    bc.settle()
    os.makedirs(path)
    buf = memoryview(bytearray(_PIECE))
    t0 = time.perf_counter()
    fd = os.open(os.path.join(path, "raw"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, buf[: min(left, _PIECE)])
        os.fsync(fd)
    finally:
        os.close(fd)
    bc.fsync_path(path)
    wall = time.perf_counter() - t0
    bc.remove(path)
    return wall


def table(rows: list[dict], floors: list[float]) -> None:
    by = {m: [r for r in rows if r["method"] == m] for m in METHODS}
    print(
        "\n| step | Orbax StandardCheckpointHandler | snapshard.orbax.Handler | Orbax / snapshard |"
    )
    print("|---|---|---|---|")
    for step in STEPS:
        o = [r[step] for r in by["orbax"]]
        s = [r[step] for r in by["snapshard"]]
        ratios = [a / b for a, b in zip(o, s, strict=True)]
        print(f"| {step} (s) | {bc.spread(o)} | {bc.spread(s)} | {bc.spread(ratios)}x |")
    checks = []
    for step, target in (("save", ">= 3"), ("restore", ">= 2")):
        o = [r[step] for r in by["orbax"]]
        s = [r[step] for r in by["snapshard"]]
        checks.append(
            (f"{step}: Orbax / snapshard", [a / b for a, b in zip(o, s, strict=True)], target)
        )
    bc.ratio_table("targets (medians of the per-round ratios)", checks)
    s = [r["save"] for r in by["snapshard"]]
    o = [r["save"] for r in by["orbax"]]
    print(f"\nraw fsync'd write of the same bytes (the disk's floor): {bc.spread(floors)} s")
    print(
        f"save / floor: snapshard {bc.spread([a / b for a, b in zip(s, floors, strict=True)])}x, "
        f"Orbax {bc.spread([a / b for a, b in zip(o, floors, strict=True)])}x"
    )
    print(f"bit exact: {all(r['bit_exact'] for r in rows)}")
    print(f"1-minute load average during the rounds: {bc.spread([r['load1'] for r in rows])}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = a.out or os.path.join(
        os.path.dirname(__file__), "results", f"orbax_handler-{stamp}.jsonl"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(f"state: {bc.payload_bytes(a.scale) / 2**20:.0f} MiB, {a.rounds} rounds -> {out}")
    warm = bc.build_tree(bc.WARMUP_LEAVES, a.scale, bc.mesh(2, 4))
    for method in METHODS:  # first calls (imports, compilation) are not measured
        run(method, warm, a.scale, bc.ckpt_dir(f"orbax-handler-{method}-warmup"))
    bc.delete_tree(warm)
    tree = bc.build_tree(list(bc.tree_spec(a.scale)), a.scale, bc.mesh(2, 4))
    rows, floors = [], []
    with open(out, "w") as f:
        for r in range(a.rounds):
            floors.append(raw_write(bc.ckpt_dir("orbax-handler-raw"), bc.payload_bytes(a.scale)))
            f.write(json.dumps({"method": "raw_write", "round": r, "save": floors[-1]}) + "\n")
            order = METHODS if r % 2 == 0 else METHODS[::-1]
            for method in order:
                res = run(method, tree, a.scale, bc.ckpt_dir(f"orbax-handler-{method}"))
                res.update(round=r, scale=a.scale, bytes=bc.payload_bytes(a.scale))
                res["load1"] = os.getloadavg()[0]  # other work on the machine meanwhile
                rows.append(res)
                f.write(json.dumps(res) + "\n")
                print(
                    json.dumps(
                        {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}
                    )
                )
    table(rows, floors)


if __name__ == "__main__":
    main()
