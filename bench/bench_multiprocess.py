"""4 processes x 2 CPU devices (jax.distributed on 127.0.0.1, gloo collectives) saving and
restoring the bench state: snapshard (single_replica, replica_parallel, balanced) against
Orbax's defaults, interleaved.

Each round starts 4 fresh worker processes. They build the state on mesh (data=2, model=4)
P(None, 'model') (each weight column band lives on two processes), save it with every
snapshard mode and with Orbax, in an order alternated between rounds, then restore both
libraries' checkpoints into the save sharding and onto mesh (4, 2) P('model', None). Every
timed step starts behind a barrier of the bench (not counted); the step's time is the
slowest process's.

Barriers per save are counted inside the workers: every call of the jax.distributed client
(wait_at_barrier, key-value set/get) goes through a counting proxy, and
multihost_utils.sync_global_devices (the device barrier Orbax uses) is wrapped; snapshard is
also given a counting Coordinator.

usage: python bench_multiprocess.py [--rounds 3] [--scale 1.0] [--out FILE.jsonl]
       python bench_multiprocess.py --analyze FILE.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

import common as bc
from snapshard import SaveOptions

HERE = os.path.dirname(os.path.abspath(__file__))
PROCS, DEVICES = 4, 2
MODES = ("single_replica", "replica_parallel", "balanced")
ENV_PID, ENV_PORT, ENV_ROUND, ENV_SCALE = (
    "BENCH_MP_PROCESS_ID",
    "BENCH_MP_PORT",
    "BENCH_MP_ROUND",
    "BENCH_MP_SCALE",
)


# ================================================================ worker side
class Counting:
    """Counts calls into the jax.distributed client and the device-level sync functions."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.depth = threading.local()

    def hit(self, name: str) -> None:
        with self.lock:
            self.calls[name] += 1

    def wrap(self, name: str, fn):
        """Count fn's outermost calls only (sync_global_devices calls process_allgather)."""

        def wrapped(*a, **k):
            d = getattr(self.depth, "n", 0)
            if d == 0:
                self.hit(name)
            self.depth.n = d + 1
            try:
                return fn(*a, **k)
            finally:
                self.depth.n = d

        return wrapped

    def take(self) -> dict[str, int]:
        with self.lock:
            out = dict(self.calls)
            self.calls.clear()
        return out


class ClientProxy:
    """Stands in for jax's distributed client: forwards everything, counting method calls."""

    def __init__(self, real, counting: Counting) -> None:
        self._real = real
        self._counting = counting

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if callable(attr):
            return self._counting.wrap(f"client.{name}", attr)
        return attr


def worker() -> None:
    pid = int(os.environ[ENV_PID])
    r = int(os.environ[ENV_ROUND])
    scale = float(os.environ[ENV_SCALE])
    bc.force_cpu_devices(DEVICES)
    bc.join_jax_job(f"127.0.0.1:{os.environ[ENV_PORT]}", PROCS, pid, timeout_s=120)
    import warnings

    import jax
    import orbax.checkpoint as ocp
    from jax._src import distributed
    from jax.experimental import multihost_utils

    import snapshard
    from snapshard.coordination import Coordinator
    from snapshard.jax.arrays import layout_of
    from snapshard.jax.distributed import JaxDistributedCoordinator
    from snapshard.planning import plan_writes

    warnings.filterwarnings("ignore")
    jax.devices()  # the backend holds its own client reference from here on
    real_client = distributed.global_state.client
    counting = Counting()
    distributed.global_state.client = ClientProxy(real_client, counting)
    for name in ("sync_global_devices", "broadcast_one_to_all", "process_allgather"):
        setattr(multihost_utils, name, counting.wrap(name, getattr(multihost_utils, name)))

    class CountingCoordinator(Coordinator):
        """snapshard's coordinator with every call counted."""

        def __init__(self, inner: Coordinator) -> None:
            self.inner = inner
            self.process_index, self.process_count = inner.process_index, inner.process_count

        def set(self, key, value):
            counting.hit("coord.set")
            self.inner.set(key, value)

        def get(self, key, timeout_s):
            counting.hit("coord.get")
            return self.inner.get(key, timeout_s)

        def try_get(self, key):
            counting.hit("coord.try_get")
            return self.inner.try_get(key)

        def barrier(self, name, timeout_s):
            counting.hit("coord.barrier")
            self.inner.barrier(name, timeout_s)

        def get_dir(self, prefix):
            counting.hit("coord.get_dir")
            return self.inner.get_dir(prefix)

        def delete(self, prefix, keys=None):
            counting.hit("coord.delete")
            self.inner.delete(prefix, keys)

        def increment(self, key, by=1):
            counting.hit("coord.increment")
            return self.inner.increment(key, by)

    coord = CountingCoordinator(JaxDistributedCoordinator())
    step_no = [0]

    def sync(tag: str) -> None:
        """The bench's own barrier, on the real client: not counted."""
        step_no[0] += 1
        real_client.wait_at_barrier(f"bench-{r}-{step_no[0]}-{tag}", 600_000)

    def emit(**kw):
        bc.emit(pid=pid, round=r, **kw)

    save_mesh, reshard_mesh = bc.mesh(2, 4), bc.mesh(4, 2)
    names = list(bc.tree_spec(scale))
    # The plan alone, no I/O: bytes per process of every mode, and the mode save's default picks.
    spec = bc.tree_spec(scale)
    layouts = [
        layout_of(
            spec[k][0],
            bc.np_dtype(spec[k][1]).itemsize,
            bc.sharding_for(spec[k][2], save_mesh, False),
        ).layout
        for k in names
    ]
    auto_mode = plan_writes(layouts, "auto", num_processes=PROCS).mode
    if pid == 0:
        for mode in (*MODES, "auto"):
            plan = plan_writes(layouts, mode, num_processes=PROCS)
            emit(
                method="plan",
                mode=mode,
                chosen=plan.mode,
                bytes_per_process=plan.bytes_per_process().tolist(),
            )

    def snap_save(tree, path, mode, record):
        if pid == 0:
            bc.fresh_dir(path)
        sync("fresh")
        bc.settle()
        sync("go")
        counting.take()
        with bc.Meter() as m:
            t = snapshard.save(path, tree, options=SaveOptions(mode=mode), coordinator=coord)
        calls = counting.take()
        if record:
            emit(
                method=f"snapshard_{mode}",
                step="save",
                bytes_written=t.bytes_written,
                blocking_s=round(t.blocking_s, 4),
                calls=calls,
                **m.as_dict("save"),
            )

    def orbax_save(tree, path, record):
        if pid == 0:
            bc.fresh_dir(path)
        sync("fresh")
        counting.take()
        opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, create=True)
        mngr = ocp.CheckpointManager(path, options=opts)
        setup_calls = counting.take()
        bc.settle()
        sync("go")
        counting.take()
        with bc.Meter() as total:
            with bc.Meter() as blk:
                mngr.save(0, args=ocp.args.StandardSave(tree))
            blocking_calls = counting.take()
            mngr.wait_until_finished()
        calls = counting.take()
        calls = dict(Counter(calls) + Counter(blocking_calls))
        if record:
            emit(
                method="orbax",
                step="save",
                blocking_calls=blocking_calls,
                setup_calls=setup_calls,
                calls=calls,
                **blk.as_dict("blocking"),
                **total.as_dict("save"),
            )
        return mngr

    def restore(lib, path, tree, mngr, record):
        for step, reshard in (("restore", False), ("reshard", True)):
            target = bc.abstract(tree, scale, reshard_mesh if reshard else save_mesh, reshard)
            sync(f"{lib}-{step}")
            stats = snapshard.ReadStats()
            with bc.Meter() as m:
                if lib == "orbax":
                    out = mngr.restore(0, args=ocp.args.StandardRestore(target))
                else:
                    out = snapshard.load(path, target, stats=stats)
                jax.block_until_ready(out)
            if record:
                extra = {"stats": stats.as_dict()} if lib != "orbax" else {}
                ok = bc.check_restored(bc.flatten(out), scale)
                emit(method=lib, step=step, bit_exact=ok, **extra, **m.as_dict("op"))
            bc.delete_tree(out)
            del out

    def one_round(tree, record):
        """Saves of every library and mode, then restores; returns nothing (emits)."""
        tag = "" if record else "-warmup"
        libs = ["snapshard", "orbax"] if r % 2 == 0 else ["orbax", "snapshard"]
        modes = list(MODES[r % 3 :] + MODES[: r % 3])
        paths = {m: bc.ckpt_dir(f"mp/snapshard-{m}{tag}") for m in MODES}
        opath = bc.ckpt_dir(f"mp/orbax{tag}")
        mngr = None
        for lib in libs:
            if lib == "orbax":
                mngr = orbax_save(tree, opath, record)
                continue
            for mode in modes:
                snap_save(tree, paths[mode], mode, record)
                sync("saved")
                if mode != auto_mode and pid == 0:
                    bc.remove(paths[mode])  # keep the disk use down; restore reads one
        abstract_tree = bc.abstract(tree, scale, save_mesh, False)
        bc.delete_tree(tree)  # free the source before the restores (memory)
        for lib in libs:
            restore(lib, paths[auto_mode], abstract_tree, mngr, record)
        sync("restored")
        if mngr is not None:
            mngr.close()
        if pid == 0:
            for p in [*paths.values(), opath]:
                bc.remove(p)

    warm = bc.build_tree(bc.WARMUP_LEAVES, scale, save_mesh)
    one_round(warm, record=False)
    t0 = time.perf_counter()
    tree = bc.build_tree(names, scale, save_mesh)
    emit(method="setup", build_s=round(time.perf_counter() - t0, 2), auto_mode=auto_mode)
    one_round(tree, record=True)
    sync("end")
    distributed.global_state.client = real_client
    jax.distributed.shutdown()


# ================================================================ driver side
def run_round(r: int, scale: float, out, logs: str, timeout: float) -> None:
    os.sync()
    time.sleep(2)
    port = bc.free_port()
    procs = []
    load0 = os.getloadavg()[0]
    busy0, cpu0, t0 = bc.sys_cpu()[0], bc.children_cpu(), time.perf_counter()
    errs = []
    for pid in range(PROCS):
        env = dict(os.environ)
        env.update(
            {
                ENV_PID: str(pid),
                ENV_PORT: str(port),
                ENV_ROUND: str(r),
                ENV_SCALE: str(scale),
                "PYTHONUNBUFFERED": "1",
            }
        )
        err = open(os.path.join(logs, f"r{r}_p{pid}.err"), "w")  # noqa: SIM115
        errs.append(err)
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker"],
                cwd=HERE,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        )
    n = 0
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"[round {r}] timed out after {timeout} s; killing the workers", flush=True)
                break
            for line in stdout.splitlines():
                if line.startswith("RESULT "):
                    d = json.loads(line[7:])
                    d.update(scale=scale, wallclock=time.time())
                    out.write(json.dumps(d) + "\n")
                    n += 1
    finally:
        for p in procs:  # however the round ended, none of its processes survive it
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for e in errs:
            e.close()
    wall = time.perf_counter() - t0
    cpu = bc.children_cpu() - cpu0
    rcs = [p.returncode for p in procs]
    out.write(
        json.dumps(
            {
                "method": "job",
                "round": r,
                "rcs": rcs,
                "wall_s": round(wall, 2),
                "sys_busy_s": round(bc.sys_cpu()[0] - busy0, 2),
                "workers_cpu_s": round(cpu, 2),
                "loadavg_1m_start": load0,
                "loadavg_1m_end": os.getloadavg()[0],
            }
        )
        + "\n"
    )
    out.flush()
    print(f"[round {r}] {wall:.0f} s, {n} results, exit codes {rcs}", flush=True)


# ---------------------------------------------------------------- analysis
med = statistics.median


def analyze(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    scale = next((r["scale"] for r in rows if "scale" in r), 1.0)
    # (method, step, round) -> rows of every process
    steps: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
    for row in rows:
        if "step" in row:
            steps[row["method"], row["step"], row["round"]].append(row)

    def slowest(method: str, step: str, key: str) -> dict[int, float]:
        """Per round: the slowest process's value (every process must have reported)."""
        out = {}
        for (m, s, r), rs in steps.items():
            if m == method and s == step and len(rs) == PROCS:
                out[r] = max(x[key] for x in rs)
        return out

    def per_process(method: str, key: str) -> list[list[float]]:
        out = []
        for (m, s, _), rs in sorted(steps.items()):
            if m == method and s == "save" and len(rs) == PROCS:
                out.append([x[key] for x in sorted(rs, key=lambda x: x["pid"])])
        return out

    def calls(method: str, field: str = "calls", pids=None) -> Counter:
        """Calls per save of one process, median over rounds and the processes `pids`."""
        rs = [
            x
            for (m, s, _), v in steps.items()
            if m == method and s == "save"
            for x in v
            if pids is None or x["pid"] in pids
        ]
        names = set().union(*(x.get(field, {}) for x in rs)) if rs else set()
        return Counter({k: med([x.get(field, {}).get(k, 0) for x in rs]) for k in names})

    def barriers(c: Counter) -> float:
        return (
            c["client.wait_at_barrier"]
            + c["sync_global_devices"]
            + c["coord.barrier"]
            + c["client.wait_at_barrier_async"]
        )

    print(f"# Multi-process bench ({PROCS} processes x {DEVICES} CPU devices): {path}")
    print(f"state {bc.payload_bytes(scale):,} B (scale {scale}); median over rounds [min-max]\n")
    print("## Bytes written per process\n")
    print("| mode | plan: bytes per process (MB) | plan max/mean | measured max/mean |")
    print("|---|---|---|---|")
    plans = {row["mode"]: row for row in rows if row["method"] == "plan"}
    for mode in (*MODES, "auto"):
        p = plans.get(mode)
        if p is None:
            continue
        b = p["bytes_per_process"]
        mean = sum(b) / len(b)
        measured = [
            max(v) / (sum(v) / len(v))
            for v in per_process(f"snapshard_{p['chosen']}", "bytes_written")
            if sum(v)
        ]
        label = mode if mode != "auto" else f"auto (picks {p['chosen']})"
        print(
            f"| {label} | {' / '.join(f'{x / 1e6:.0f}' for x in b)} | {max(b) / mean:.3f} "
            f"| {bc.spread(measured, 3)} |"
        )
    orbax_w = [max(v) / (sum(v) / len(v)) for v in per_process("orbax", "save_proc_write_B")]
    orbax_b = per_process("orbax", "save_proc_write_B")
    if orbax_b:
        per = [med([v[i] for v in orbax_b]) / 1e6 for i in range(PROCS)]
        print(
            f"| Orbax (bytes the process wrote, /proc/self/io) | {' / '.join(f'{x:.0f}' for x in per)} "
            f"| | {bc.spread(orbax_w, 3)} |"
        )

    print("\n## Save (slowest process)\n")
    print(
        "| method | n | blocking s | save s | barriers per save (in the blocking part) "
        "| key-value sets / blocking gets / try-gets: process 0; others | other collectives |"
    )
    print("|---|---|---|---|---|---|---|")
    auto = plans.get("auto", {}).get("chosen", "balanced")

    def kv(c: Counter) -> str:
        return (
            f"{c['client.key_value_set']:.0f} / {c['client.blocking_key_value_get']:.0f} / "
            f"{c['client.key_value_try_get']:.0f}"
        )

    for m in [f"snapshard_{x}" for x in MODES] + ["orbax"]:
        s = slowest(m, "save", "save_s")
        if not s:
            continue
        b = slowest(m, "save", "blocking_s")
        c, c0, c1 = calls(m), calls(m, pids={0}), calls(m, pids=set(range(1, PROCS)))
        in_blocking = barriers(calls(m, "blocking_calls")) if m == "orbax" else 0
        coll = c["broadcast_one_to_all"] + c["process_allgather"]
        print(
            f"| {m} | {len(s)} | {bc.spread(list(b.values()))} | {bc.spread(list(s.values()))} "
            f"| {barriers(c):.0f} ({in_blocking:.0f}) | {kv(c0)}; {kv(c1)} | {coll:.0f} |"
        )
    oc, o = calls("orbax", "setup_calls"), calls("orbax")
    print(
        f"\nOrbax's barriers per save: {o['sync_global_devices']:.0f} sync_global_devices "
        f"(a device collective) + {o['client.wait_at_barrier']:.0f} client barriers; its "
        f"CheckpointManager constructor adds {barriers(oc):.0f} more per manager (not counted "
        "above). snapshard's coordinator calls per save, process 0: "
        + ", ".join(
            f"{k} {v:.0f}"
            for k, v in sorted(calls(f"snapshard_{auto}", pids={0}).items())
            if k.startswith("coord.")
        )
        + "; the others: "
        + ", ".join(
            f"{k} {v:.0f}"
            for k, v in sorted(calls(f"snapshard_{auto}", pids={1, 2, 3}).items())
            if k.startswith("coord.")
        )
        + "."
    )

    print("\n## Restore (slowest process)\n")
    print(
        "| method | restore s | reshard s | bytes read / needed (max over processes) | bit-exact |"
    )
    print("|---|---|---|---|---|")
    for m in ("snapshard", "orbax"):
        res, re = slowest(m, "restore", "op_s"), slowest(m, "reshard", "op_s")
        amp = [
            max(x["stats"]["read_amplification"] for x in rs)
            for (mm, _, _), rs in steps.items()
            if mm == m and "stats" in rs[0]
        ]
        exact = all(
            x.get("bit_exact", False)
            for (mm, s, _), rs in steps.items()
            if mm == m and s != "save"
            for x in rs
        )
        print(
            f"| {m} | {bc.spread(list(res.values()))} | {bc.spread(list(re.values()))} "
            f"| {bc.spread(amp, 3)} | {exact} |"
        )

    def paired(a: dict[int, float], b: dict[int, float]) -> list[float]:
        return [a[k] / b[k] for k in a if b.get(k)]

    snap_auto = f"snapshard_{auto}"
    bal = [
        max(v) / (sum(v) / len(v))
        for v in per_process("snapshard_balanced", "bytes_written")
        if sum(v)
    ]
    checks = [
        (
            f"save: Orbax s / snapshard s ({auto}, the default)",
            paired(slowest("orbax", "save", "save_s"), slowest(snap_auto, "save", "save_s")),
            ">= 3",
        ),
        (
            "save: Orbax s / snapshard replica_parallel s",
            paired(
                slowest("orbax", "save", "save_s"),
                slowest("snapshard_replica_parallel", "save", "save_s"),
            ),
            "",
        ),
        ("balanced: bytes written max/mean", bal, "<= 1.05"),
        (
            "restore: Orbax s / snapshard s",
            paired(slowest("orbax", "restore", "op_s"), slowest("snapshard", "restore", "op_s")),
            "",
        ),
        (
            "reshard: Orbax s / snapshard s",
            paired(slowest("orbax", "reshard", "op_s"), slowest("snapshard", "reshard", "op_s")),
            "",
        ),
    ]
    bc.ratio_table("Ratios (paired by round)", checks, 3)

    jobs = [row for row in rows if row["method"] == "job"]
    if jobs:
        busy = [j["sys_busy_s"] / j["wall_s"] for j in jobs]
        others = [max(0.0, j["sys_busy_s"] - j["workers_cpu_s"]) / j["wall_s"] for j in jobs]
        print(
            f"\nMachine: {os.cpu_count()} cores; busy during the rounds {bc.spread(busy)} cores, of "
            f"which others (not the bench's workers; kernel writeback included) {bc.spread(others)}; "
            f"1-min load average at round start {bc.spread([j['loadavg_1m_start'] for j in jobs])}; "
            f"round wall {bc.spread([j['wall_s'] for j in jobs], 0)} s; exit codes "
            f"{[j['rcs'] for j in jobs]}"
        )


def main() -> None:
    if "--worker" in sys.argv:
        worker()
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the state size")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per round")
    ap.add_argument("--out", default=None, help="JSON-lines file (default: bench/results/...)")
    ap.add_argument("--analyze", default=None, metavar="FILE", help="print the tables of FILE")
    args = ap.parse_args()
    if args.analyze:
        analyze(args.analyze)
        return
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"multiprocess-{stamp}.jsonl")
    logs = os.path.splitext(out_path)[0] + "-logs"
    os.makedirs(logs, exist_ok=True)
    print(f"results: {out_path}; checkpoints under {bc.bench_dir()}", flush=True)
    with open(out_path, "a") as out:
        for r in range(args.rounds):
            run_round(r, args.scale, out, logs, args.timeout)
    bc.remove(os.path.join(bc.bench_dir(), "ckpt", "mp"))
    analyze(out_path)


if __name__ == "__main__":
    main()
