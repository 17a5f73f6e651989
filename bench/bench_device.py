"""Figures on an accelerator: snapshard's blocking, durable-save and restore times next to the
floors of the same bytes on the same device, printed as one markdown table.

Two states: ~1 GiB in 24 float32 arrays (2736 x 4096 each) and 10,000 small float32 arrays
(256 each). For each, every round measures, paired (both sides in the same round, their
order alternating between rounds):

  JAX (the default backend: TPU, GPU, else CPU)
    save_async returns   snapshard.save_async() until it returns   | jax.device_get (D2H)
    save_async durable   ... until wait() returns                   | device_get + write + fsync
    save, durable        snapshard.save()                           | device_get + write + fsync
    load onto device     snapshard.load() onto the arrays' sharding | file read + jax.device_put
  torch on CUDA
    the same four with snapshard.torch.save_async/save/load (in place into CUDA tensors);
    floors: copy_(non_blocking=True) into pinned host buffers allocated beforehand + a
    synchronize; the same + write + fsync; a file read into a pinned buffer + copy to the
    device tensors + a synchronize.

Every JAX measurement saves a fresh on-device copy of the state (a jax.Array keeps its host
copy once fetched, which would make a second device_get free). Reads are warm (the files were
just written, by both sides). Medians over rounds [min-max]; ratios snapshard / floor are
paired per round before the median. Each framework runs in a process of its own; a framework
whose device is missing gets a "not measured" row.

usage: python bench/bench_device.py [--rounds 5] [--budget-s 420] [--out FILE.jsonl]
       python bench/bench_device.py --dry-run      # CPU, tiny sizes (CI: scripts/device_check.sh)
Checkpoints go under $SNAPSHARD_BENCH_DIR (default: <temp dir>/snapshard-bench) and are
deleted after every round. scripts/device_check.sh sets up the environment and runs this.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import common as bc

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = ("jax", "torch")
OPS = (
    ("blocking", "save_async returns"),
    ("async_total", "save_async durable"),
    ("save", "save, durable"),
    ("load", "load onto device"),
)


@dataclass(frozen=True)
class State:
    name: str
    count: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.count * int(np.prod(self.shape)) * 4

    def label(self) -> str:
        each = int(np.prod(self.shape)) * 4
        size = f"{each / 2**20:.0f} MiB" if each >= 2**20 else f"{each / 2**10:.0f} KiB"
        total = self.nbytes
        tot = f"{total / 2**30:.2f} GiB" if total >= 2**30 else f"{total / 2**20:.1f} MiB"
        return f"{self.count:,} x {size} f32 ({tot})"


# The share of a job's time each state's rounds get.
WEIGHT = {"large": 2.0, "small": 1.0}


def states(dry_run: bool) -> list[State]:
    if dry_run:
        return [State("large", 24, (64, 128)), State("small", 300, (256,))]
    return [State("large", 24, (2736, 4096)), State("small", 10_000, (256,))]


def now() -> float:
    return time.perf_counter()


def write_fsync(path: str, chunks: list[Any]) -> None:
    """The raw durable write: every chunk into one file, fsync'd with its directory."""
    with open(path, "wb", buffering=0) as f:
        for c in chunks:
            f.write(memoryview(c).cast("B"))
        os.fsync(f.fileno())
    bc.fsync_path(os.path.dirname(path))


def read_into(path: str, buf: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf).cast("B")
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise OSError(f"{path}: short read ({got} of {len(view)} B)")
            got += n


class Rounds:
    """Runs the rounds of one state: a warm-up (not recorded), then up to `rounds` rounds while
    the time left allows another."""

    def __init__(self, rounds: int, deadline: float) -> None:
        self.rounds, self.deadline = rounds, deadline

    def run(self, one: Callable[[int], None]) -> int:
        t0 = now()
        one(-1)
        longest = now() - t0
        done = 0
        for r in range(self.rounds):
            if done and now() + longest > self.deadline:
                break
            t0 = now()
            one(r)
            longest = max(longest, now() - t0)
            done += 1
        return done


def pair(
    r: int, snap: Callable[[], dict[str, float]], floor: Callable[[], float]
) -> dict[str, Any]:
    """Both sides of one measurement, in an order that alternates with the round."""
    out: dict[str, Any] = {}
    for side in ("snap", "floor") if r % 2 == 0 else ("floor", "snap"):
        bc.settle()
        if side == "snap":
            out.update(snap())
        else:
            out["floor_s"] = floor()
    return out


# ---------------------------------------------------------------- JAX
def jax_job(args: argparse.Namespace, deadline: float) -> None:
    import jax
    from jax.sharding import Mesh

    devs = jax.devices()
    bc.emit(
        kind="device",
        framework="jax",
        backend=jax.default_backend(),
        device=f"{len(devs)} x {devs[0].device_kind}",
        version=f"jax {jax.__version__}",
    )
    mesh = Mesh(np.array(devs), ("d",))
    todo = states(args.dry_run)
    for si, st in enumerate(todo):
        share = (deadline - now()) * WEIGHT[st.name] / sum(WEIGHT[t.name] for t in todo[si:])
        jax_state(st, mesh, Rounds(args.rounds, now() + share))
    bc.remove(bc.ckpt_dir("device-jax"))


def jax_state(st: State, mesh: Any, rounds: Rounds) -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import snapshard

    sh = NamedSharding(mesh, P("d") if st.shape[0] % mesh.size == 0 else P())
    gen = jax.jit(
        lambda i: jax.random.normal(jax.random.fold_in(jax.random.key(0), i), st.shape),
        out_shardings=sh,
    )
    names = [f"a{i:05d}" for i in range(st.count)]
    src = {k: gen(np.uint32(i)) for i, k in enumerate(names)}
    jax.block_until_ready(src)
    target = {k: jax.ShapeDtypeStruct(st.shape, jnp.float32, sharding=sh) for k in names}
    sample = [names[0], names[len(names) // 2], names[-1]]
    root = bc.ckpt_dir("device-jax")

    def fresh() -> dict[str, Any]:
        """A new on-device copy of the state: no host value cached on it."""
        out = jax.device_put(src, may_alias=False)
        jax.block_until_ready(out)
        return out

    def delete(tree: Any) -> None:
        for x in jax.tree.leaves(tree):
            x.delete()

    def one(r: int) -> None:
        base = os.path.join(root, f"{st.name}-r{r}")
        bc.fresh_dir(os.path.join(base, "x"))
        res: dict[str, dict[str, Any]] = {}
        exact = {"ok": True}

        def snap_async() -> dict[str, float]:
            tree = fresh()
            t0 = now()
            job = snapshard.save_async(os.path.join(base, "async"), tree)
            blocking = now() - t0
            job.wait()
            total = now() - t0
            delete(tree)
            return {"snap_s": blocking, "total_s": total}

        def floor_get() -> float:
            tree = fresh()
            t0 = now()
            host = jax.device_get(tree)
            s = now() - t0
            del host
            delete(tree)
            return s

        def snap_save() -> dict[str, float]:
            tree = fresh()
            t0 = now()
            snapshard.save(os.path.join(base, "ckpt"), tree)
            s = now() - t0
            delete(tree)
            return {"snap_s": s}

        def floor_save() -> float:
            tree = fresh()
            t0 = now()
            host = jax.device_get(tree)
            write_fsync(os.path.join(base, "floor.bin"), [host[k] for k in names])
            s = now() - t0
            del host
            delete(tree)
            return s

        def snap_load() -> dict[str, float]:
            t0 = now()
            out = snapshard.load(os.path.join(base, "ckpt"), target)
            jax.block_until_ready(out)
            s = now() - t0
            exact["ok"] &= all(out[k].sharding == sh for k in sample) and all(
                np.array_equal(np.asarray(out[k]), np.asarray(src[k])) for k in sample
            )
            delete(out)
            return {"snap_s": s}

        def floor_load() -> float:
            buf = np.empty(st.nbytes, np.uint8)  # allocated outside the time
            t0 = now()
            read_into(os.path.join(base, "floor.bin"), buf)
            flat = buf.view(np.float32)
            n = int(np.prod(st.shape))
            host = [flat[i * n : (i + 1) * n].reshape(st.shape) for i in range(st.count)]
            out = jax.device_put(host, sh)
            jax.block_until_ready(out)
            s = now() - t0
            exact["ok"] &= all(
                np.array_equal(np.asarray(out[names.index(k)]), np.asarray(src[k])) for k in sample
            )
            delete(out)
            return s

        a = pair(r, snap_async, floor_get)
        res["blocking"] = {"snap_s": a["snap_s"], "floor_s": a["floor_s"]}
        res["save"] = pair(r, snap_save, floor_save)
        res["async_total"] = {"snap_s": a["total_s"], "floor_s": res["save"]["floor_s"]}
        res["load"] = pair(r, snap_load, floor_load)
        bc.remove(base)
        if r >= 0:
            emit_round("jax", st, r, res, exact["ok"])

    rounds.run(one)
    delete(src)


def emit_round(fw: str, st: State, r: int, res: dict[str, dict[str, Any]], exact: bool) -> None:
    for op, d in res.items():
        bc.emit(
            kind="op", framework=fw, state=st.name, nbytes=st.nbytes, round=r, op=op,
            snap_s=d["snap_s"], floor_s=d["floor_s"], bit_exact=exact,
        )  # fmt: skip


# ---------------------------------------------------------------- torch
def torch_job(args: argparse.Namespace, deadline: float) -> None:
    try:
        import torch
    except ImportError:
        bc.emit(kind="skip", framework="torch", reason="torch is not installed")
        return
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        bc.emit(
            kind="skip",
            framework="torch",
            reason=f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)",
        )
        return
    bc.emit(
        kind="device",
        framework="torch",
        backend="cuda" if cuda else "cpu",
        device=torch.cuda.get_device_name(0) if cuda else "cpu",
        version=f"torch {torch.__version__}",
    )
    todo = states(args.dry_run)
    for si, st in enumerate(todo):
        share = (deadline - now()) * WEIGHT[st.name] / sum(WEIGHT[t.name] for t in todo[si:])
        torch_state(st, si, cuda, Rounds(args.rounds, now() + share))
        if cuda:
            torch.cuda.empty_cache()
    bc.remove(bc.ckpt_dir("device-torch"))


def torch_state(st: State, seed: int, cuda: bool, rounds: Rounds) -> None:
    import torch

    import snapshard.torch as sst

    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    g = torch.Generator(device=dev).manual_seed(seed)
    whole = torch.randn((st.count, *st.shape), device=dev, generator=g)
    names = [f"a{i:05d}" for i in range(st.count)]
    src = {k: whole[i].clone() for i, k in enumerate(names)}  # a storage of its own each
    del whole
    pinned = {k: torch.empty(st.shape, pin_memory=cuda) for k in names}  # the floor's, reused
    target = {k: torch.zeros(st.shape, device=dev) for k in names}
    sample = [names[0], names[len(names) // 2], names[-1]]
    root = bc.ckpt_dir("device-torch")
    sync()

    def d2h() -> None:
        for k, t in src.items():
            pinned[k].copy_(t, non_blocking=True)
        sync()

    def one(r: int) -> None:
        base = os.path.join(root, f"{st.name}-r{r}")
        bc.fresh_dir(os.path.join(base, "x"))
        res: dict[str, dict[str, Any]] = {}
        exact = {"ok": True}

        def snap_async() -> dict[str, float]:
            t0 = now()
            job = sst.save_async(os.path.join(base, "async"), src)
            blocking = now() - t0
            job.wait()
            return {"snap_s": blocking, "total_s": now() - t0}

        def floor_copy() -> float:
            t0 = now()
            d2h()
            return now() - t0

        def snap_save() -> dict[str, float]:
            t0 = now()
            sst.save(os.path.join(base, "ckpt"), src)
            return {"snap_s": now() - t0}

        def floor_save() -> float:
            t0 = now()
            d2h()
            write_fsync(os.path.join(base, "floor.bin"), [pinned[k].numpy() for k in names])
            return now() - t0

        def snap_load() -> dict[str, float]:
            for t in target.values():
                t.zero_()
            sync()
            t0 = now()
            sst.load(os.path.join(base, "ckpt"), target)
            sync()
            s = now() - t0
            exact["ok"] &= all(torch.equal(target[k], src[k]) for k in sample)
            return {"snap_s": s}

        def floor_load() -> float:
            for t in target.values():
                t.zero_()
            buf = torch.empty(st.nbytes, dtype=torch.uint8, pin_memory=cuda)
            sync()
            t0 = now()
            read_into(os.path.join(base, "floor.bin"), buf.numpy())
            flat = buf.view(torch.float32)
            n = int(np.prod(st.shape))
            for i, k in enumerate(names):
                target[k].copy_(flat[i * n : (i + 1) * n].view(st.shape), non_blocking=True)
            sync()
            s = now() - t0
            exact["ok"] &= all(torch.equal(target[k], src[k]) for k in sample)
            return s

        a = pair(r, snap_async, floor_copy)
        res["blocking"] = {"snap_s": a["snap_s"], "floor_s": a["floor_s"]}
        res["save"] = pair(r, snap_save, floor_save)
        res["async_total"] = {"snap_s": a["total_s"], "floor_s": res["save"]["floor_s"]}
        res["load"] = pair(r, snap_load, floor_load)
        bc.remove(base)
        if r >= 0:
            emit_round("torch", st, r, res, exact["ok"])

    rounds.run(one)


# ---------------------------------------------------------------- the table
FLOORS = {
    "jax": {
        "blocking": "jax.device_get",
        "async_total": "device_get + write + fsync",
        "save": "device_get + write + fsync",
        "load": "file read + jax.device_put",
    },
    "torch": {
        "blocking": "copy_ into pinned + sync",
        "async_total": "pinned copy + write + fsync",
        "save": "pinned copy + write + fsync",
        "load": "file read (pinned) + H2D copy + sync",
    },
}


def table(rows: list[dict[str, Any]], dry_run: bool) -> None:
    med = statistics.median
    devices = {r["framework"]: r for r in rows if r.get("kind") == "device"}
    skips = {r["framework"]: r["reason"] for r in rows if r.get("kind") == "skip"}
    ops: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r.get("kind") == "op":
            ops[r["framework"], r["state"], r["op"]].append(r)
    print()
    print(
        "| framework | device | state | operation | snapshard s | floor s | floor "
        "| snapshard / floor | snapshard GB/s | n | bit-exact |"
    )
    print("|" + "---|" * 11)
    for fw in JOBS:
        dev = devices.get(fw)
        where = f"{dev['backend']}: {dev['device']}" if dev else "-"
        if fw in skips or not dev:
            why = skips.get(fw, "no results (see the job's output above)")
            print(f"| {fw} | {where} | - | not measured: {why} | | | | | | | |")
            continue
        for st in states(dry_run):
            for op, title in OPS:
                got = ops.get((fw, st.name, op), [])
                if not got:
                    print(f"| {fw} | {where} | {st.label()} | {title}: no rounds | | | | | | | |")
                    continue
                snap = [g["snap_s"] for g in got]
                floor = [g["floor_s"] for g in got]
                ratios = [g["snap_s"] / g["floor_s"] for g in got if g["floor_s"] > 0]
                gbps = [st.nbytes / s / 1e9 for s in snap if s > 0]
                exact = "yes" if all(g["bit_exact"] for g in got) else "NO"
                print(
                    f"| {fw} | {where} | {st.label()} | {title} | {bc.spread(snap, 4)} "
                    f"| {bc.spread(floor, 4)} | {FLOORS[fw][op]} | {bc.spread(ratios)} "
                    f"| {med(gbps):.2f} | {len(got)} | {exact} |"
                )
    if "jax" in devices and devices["jax"]["backend"] != "gpu":
        print(
            f"| jax | gpu | - | not measured: JAX's backend here is {devices['jax']['backend']} "
            "| | | | | | | |"
        )


# ---------------------------------------------------------------- driver
def run_job(job: str, args: argparse.Namespace, budget: float, out: Any) -> list[dict[str, Any]]:
    cmd = [sys.executable, os.path.abspath(__file__), "--job", job, "--rounds", str(args.rounds)]
    cmd += ["--budget-s", f"{budget:.0f}"] + (["--dry-run"] if args.dry_run else [])
    env = dict(os.environ)
    if args.dry_run:
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    t0 = now()
    try:
        p = subprocess.run(
            cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, text=True, timeout=budget + 60
        )
        stdout, rc = p.stdout, str(p.returncode)
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or ""
        stdout, rc = raw.decode() if isinstance(raw, bytes) else raw, "timeout"
    rows = []
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            d = json.loads(line[7:])
            rows.append(d)
            out.write(json.dumps(d) + "\n")
    print(f"[{job}] {now() - t0:.0f} s, {len(rows)} results, rc={rc}", file=sys.stderr, flush=True)
    if rc != "0":
        rows.append({"kind": "skip", "framework": job, "reason": f"its job failed (rc={rc})"})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (dry run: 2)")
    ap.add_argument("--budget-s", type=float, default=None, help="default 420 (dry run: 60)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--job", choices=JOBS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.rounds = args.rounds or (2 if args.dry_run else 5)
    budget = args.budget_s or (60.0 if args.dry_run else 420.0)
    start = now()
    if args.job:
        (jax_job if args.job == "jax" else torch_job)(args, start + budget)
        return
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = args.out or os.path.join(HERE, "results", f"device-{stamp}.jsonl")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    rows: list[dict[str, Any]] = []
    # torch first: where it is missing or finds no CUDA device it ends at once, and JAX gets
    # the whole budget.
    jobs = ("torch", "jax")
    with open(out_path, "a") as out:
        for i, job in enumerate(jobs):
            if job == "torch" and importlib.util.find_spec("torch") is None:
                rows.append({"kind": "skip", "framework": job, "reason": "torch is not installed"})
                continue
            left = budget - (now() - start)
            rows += run_job(job, args, max(left / (len(jobs) - i), 10.0), out)
    fs = subprocess.run(
        ["stat", "-f", "-c", "%T", bc.bench_dir() if os.path.exists(bc.bench_dir()) else "."],
        capture_output=True,
        text=True,
    ).stdout.strip()
    kind = "dry run: CPU, tiny sizes; not figures" if args.dry_run else "figures"
    print(
        f"\n## snapshard on the device ({kind}); {args.rounds} rounds at most, medians "
        f"[min-max], ratios paired per round; checkpoints on {fs or '?'}; {out_path}"
    )
    table(rows, args.dry_run)
    print(f"\n{now() - start:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
