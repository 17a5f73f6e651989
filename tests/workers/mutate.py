"""Mutation worker: damage fresh copies of checkpoints and record how snapshard reacts.

usage: mutate.py JOBS.json RESULTS.jsonl

JOBS.json: {"sources": {name: directory}, "outside": directory, "mutations": [...]}, where
each source has a pristine checkpoint and `outside` holds files outside every checkpoint
(see tests/test_mutations.py). For each mutation the source is copied, the mutation's
operations applied, and the copy loaded with `snapshard.load` (no target; a target of
ShapeDtypeStructs with shardings) and run through `snapshard verify`, each under a time cap,
the whole process under an address-space limit. One JSON line per mutation is appended to
RESULTS.jsonl as soon as it is done: {"id", "outcomes": {step: [class, detail]}}, with class
one of "error" (a SnapshardError), "other" (another exception), "identical", "different",
"outside" (the result holds what lies outside the checkpoint), "hang" (time cap hit),
"verify_ok" / "verify_damaged" (the exit status of verify).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib
import io
import json
import resource
import shutil
import signal
import struct
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
from snapshard.checksum import crc32c
from snapshard.cli import main as cli
from snapshard.errors import SnapshardError
from snapshard.format import records as rec
from snapshard.format.binding import name_key

CAP_S = 2.0
MEMORY = 4 << 30
SENTINEL = "outside-the-checkpoint"


class Hang(BaseException):
    """The time cap of one step was hit (a BaseException: no library handler catches it)."""


_FIFOS: list[Path] = []


def _on_alarm(signum: int, frame: Any) -> None:
    # Release any thread blocked opening or reading a FIFO, then stop the step.
    for f in _FIFOS:
        with contextlib.suppress(OSError):
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
    raise Hang()


# ---- comparing results bit-exactly ---------------------------------------------------------


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def canon(x: Any) -> Any:
    """A hashable, bit-exact description of a loaded tree."""
    if isinstance(x, dict):
        return ("dict", tuple((type(k).__name__, k, canon(v)) for k, v in x.items()))
    if isinstance(x, list | tuple):
        return (type(x).__name__, tuple(canon(v) for v in x))
    if _is_key(x):
        data = np.asarray(jax.random.key_data(x))
        return ("key", str(jax.random.key_impl(x)), data.dtype.str, data.shape, data.tobytes())
    if isinstance(x, jax.Array):
        a = np.asarray(x)
        return ("jax", a.dtype.str, a.shape, a.tobytes(), repr(x.sharding))
    if isinstance(x, np.ndarray | np.generic):
        a = np.asarray(x)
        return (type(x).__name__, a.dtype.str, a.shape, a.tobytes())
    if isinstance(x, float):
        return ("float", struct.pack("<d", x))
    return (type(x).__name__, x)


def leaves_of(c: Any) -> list[Any]:
    """The leaf descriptions of a canon() value."""
    if isinstance(c, tuple) and c and c[0] == "dict":
        return [leaf for _, _, v in c[1] for leaf in leaves_of(v)]
    if isinstance(c, tuple) and c and c[0] in ("list", "tuple"):
        return [leaf for v in c[1] for leaf in leaves_of(v)]
    return [c]


def target_of(tree: Any, mesh: Mesh) -> Any:
    """ShapeDtypeStructs with shardings for a loaded tree (Python values stay values)."""

    def one(x: Any) -> Any:
        if _is_key(x) or isinstance(x, np.ndarray | np.generic):
            shape = tuple(x.shape)
            spec = P("x") if shape and shape[0] % 8 == 0 and shape[0] else P()
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(mesh, spec))
        return None if isinstance(x, bytes) else x  # bytes values cannot be asked for

    return jax.tree_util.tree_map(one, tree, is_leaf=lambda x: _is_key(x))


# ---- mutations -------------------------------------------------------------------------


def _files(root: Path) -> dict[str, list[str]]:
    def ls(sub: str) -> list[str]:
        d = root / sub
        return sorted(f"{sub}/{n}" for n in os.listdir(d)) if d.is_dir() else []

    return {"data": ls("data"), "index": ls("index")}


def _pick(root: Path, sel: str) -> Path:
    """'manifest', 'data:k' or 'index:k' (k taken modulo the number of such files)."""
    if sel == "manifest":
        return root / "manifest.json"
    kind, k = sel.split(":")
    names = _files(root)[kind]
    return root / names[int(k) % len(names)]


def _encode(x: Any) -> str:
    """JSON, compact; {"__pairs__": [[k, v], ...]} becomes an object that may repeat keys."""
    if isinstance(x, dict):
        if "__pairs__" in x:
            items = x["__pairs__"]
        else:
            items = list(x.items())
        return "{" + ",".join(json.dumps(str(k)) + ":" + _encode(v) for k, v in items) + "}"
    if isinstance(x, list):
        return "[" + ",".join(_encode(v) for v in x) + "]"
    return json.dumps(x)


def _walk(doc: Any, path: list[Any]) -> tuple[Any, Any]:
    """(container, key) of the element at `path`."""
    node = doc
    for k in path[:-1]:
        node = node[k]
    return node, path[-1]


_DEEP = "__deep__"


def _deep(depth: int, style: str) -> str:
    """A placeholder for a value nested `depth` deep, expanded as text by _manifest_bytes
    (no recursion here)."""
    return f"{_DEEP}{depth}:{style}"


def _expand_deep(raw: bytes) -> bytes:
    while (at := raw.find(b'"' + _DEEP.encode())) >= 0:
        end = raw.index(b'"', at + 1)
        depth, style = raw[at + 1 + len(_DEEP) : end].decode().split(":")
        n = int(depth)
        if style == "tree":
            text = b'{"t":"list","c":[' * n + b'{"t":"leaf","i":0}' + b"]}" * n
        else:
            text = b"[" * n + b"0" + b"]" * n
        raw = raw[:at] + text + raw[end + 1 :]
    return raw


def _apply_edit(doc: Any, e: dict[str, Any]) -> None:
    kind = e["e"]
    if kind == "set":
        c, k = _walk(doc, e["path"])
        c[k] = _deep(e["depth"], e["style"]) if "depth" in e else e["value"]
    elif kind == "del":
        c, k = _walk(doc, e["path"])
        del c[k]
    elif kind == "dup":
        c, k = _walk(doc, e["path"])
        c.insert(k + 1, json.loads(json.dumps(c[k])))
    elif kind == "swap":
        ca, ka = _walk(doc, e["a"])
        cb, kb = _walk(doc, e["b"])
        ca[ka], cb[kb] = cb[kb], ca[ka]
    elif kind == "dupkey":
        c, k = _walk(doc, e["path"])
        items = list(c[k].items())
        key = items[e["key"] % len(items)][0]
        extra = [key, e["value"]]
        c[k] = {"__pairs__": [extra, *items] if e["first"] else [*items, extra]}
    elif kind == "double_shape":
        c, k = _walk(doc, e["path"])
        c[k] = [2 * s for s in c[k]] if c[k] else [2]
    else:
        raise ValueError(kind)


def _manifest_bytes(doc: Any, fix: bool, old: bytes) -> bytes:
    raw = _expand_deep(_encode(doc).encode())
    key = b'"checksum":"'
    at = raw.find(key)
    if at < 0:
        return raw
    at += len(key)
    if fix:
        crc = crc32c(raw[:at] + b"00000000" + raw[at + 8 :])
        return raw[:at] + f"{crc:08x}".encode() + raw[at + 8 :]
    return raw


def _edit_json(root: Path, edits: list[dict[str, Any]], fix: bool) -> None:
    p = root / "manifest.json"
    old = p.read_bytes()
    doc = json.loads(old)
    for e in edits:
        _apply_edit(doc, e)
    p.write_bytes(_manifest_bytes(doc, fix, old))


def _record_layout(data: bytes) -> tuple[int, np.ndarray]:
    _, _, proc, n, *_ = rec.HEADER.unpack_from(data)
    d = np.frombuffer(
        data[rec.HEADER_SIZE : rec.HEADER_SIZE + n * rec.DIR_ENTRY_SIZE], rec.DIR_ENTRY
    )
    return proc, d.copy()


def _write_dir(buf: bytearray, a: int, entry: np.ndarray) -> None:
    at = rec.HEADER_SIZE + a * rec.DIR_ENTRY_SIZE
    buf[at : at + rec.DIR_ENTRY_SIZE] = entry.tobytes()


def _resegment(buf: bytearray, proc: int, d: np.ndarray, a: int, ndim: int, salt: int) -> None:
    """Recompute the checksum of leaf a's segment after an edit (`salt`: see records)."""
    off, n = int(d[a]["offset"]), int(d[a]["count"])
    size = n * rec.record_dtype(ndim).itemsize
    d[a]["crc"] = rec.segment_crc(bytes(buf[off : off + size]), proc, a, salt)
    _write_dir(buf, a, d[a])


def _fit(v: int, bits: int) -> int:
    """v as an unsigned field of `bits` bits: too large saturates, negative wraps."""
    return min(v, (1 << bits) - 1) if v >= 0 else v % (1 << bits)


def _salt(root: Path, record: Path) -> int:
    """The segment checksums' salt of a record file (format.binding; 0 before 2.1)."""
    doc = json.loads((root / "manifest.json").read_bytes())
    return name_key(f"index/{record.name}") if doc.get("version") == "2.1" else 0


def _ndims(root: Path) -> list[int]:
    doc = json.loads((root / "manifest.json").read_bytes())
    return [len(leaf.get("shape", [])) for leaf in doc["leaves"]]


def _record_op(root: Path, op: dict[str, Any]) -> None:
    p = _pick(root, f"index:{op.get('file', 0)}")
    buf = bytearray(p.read_bytes())
    proc, d = _record_layout(bytes(buf))
    used = [a for a in range(len(d)) if d[a]["count"]]
    if not used:
        return
    a = used[op["leaf"] % len(used)]
    ndims = _ndims(root)
    salt = _salt(root, p)
    kind = op["op"]
    if kind == "rec_entry":  # a directory entry changed (pointing elsewhere, huge count…)
        v = op["value"]
        if v == "other":
            b = used[(used.index(a) + 1) % len(used)]
            v = int(d[b]["offset"])
        d[a][op["field"]] = _fit(v, 64 if op["field"] == "offset" else 32)
        _write_dir(buf, a, d[a])
    elif kind == "rec_swap":  # two leaves' entries (and so their segments) swapped
        b = used[(used.index(a) + 1) % len(used)]
        d[[a, b]] = d[[b, a]]
        _write_dir(buf, a, d[a])
        _write_dir(buf, b, d[b])
    elif kind == "rec_field":  # one field of one record, segment checksum recomputed
        dt = rec.record_dtype(ndims[a])
        off = int(d[a]["offset"])
        k = op["rec"] % int(d[a]["count"])
        r = np.frombuffer(
            bytes(buf[off + k * dt.itemsize : off + (k + 1) * dt.itemsize]), dt
        ).copy()
        f = op["field"]
        if f in ("start", "stop"):
            if ndims[a] == 0:
                return
            r[f][0][op["axis"] % ndims[a]] = op["value"]
        else:
            bits = 64 if r.dtype[f].itemsize == 8 else 32
            r[f] = _fit(op["value"], bits)
        buf[off + k * dt.itemsize : off + (k + 1) * dt.itemsize] = r.tobytes()
        _resegment(buf, proc, d, a, ndims[a], salt)
    elif kind == "rec_dup_record":  # a record duplicated over its neighbour
        dt = rec.record_dtype(ndims[a])
        off, n = int(d[a]["offset"]), int(d[a]["count"])
        if n < 2:
            return
        k = op["rec"] % (n - 1)
        one = buf[off + k * dt.itemsize : off + (k + 1) * dt.itemsize]
        buf[off + (k + 1) * dt.itemsize : off + (k + 2) * dt.itemsize] = one
        _resegment(buf, proc, d, a, ndims[a], salt)
    elif kind == "rec_count":  # fewer records (a chunk dropped), segment checksum recomputed
        d[a]["count"] = max(int(d[a]["count"]) - 1, 0)
        _resegment(buf, proc, d, a, ndims[a], salt)
    p.write_bytes(bytes(buf))


def _fix_record_crcs(root: Path) -> None:
    """Make the manifest's record sizes and checksums match the (damaged) record files."""
    p = root / "manifest.json"
    doc = json.loads(p.read_bytes())
    table = doc.get("processes")
    if not isinstance(table, dict):
        return
    nonces = table["nonce"]
    crcs, sizes = [], []
    for q in range(len(nonces) // 8):
        f = root / f"index/p{q:05d}-{nonces[8 * q : 8 * q + 8]}.idx"
        data = f.read_bytes() if f.is_file() else b""
        crcs.append(f"{crc32c(data):08x}")
        sizes.append(len(data))
    table["record_crc32c"], table["record_sizes"] = "".join(crcs), sizes
    p.write_bytes(_manifest_bytes(doc, True, b""))


def apply(root: Path, outside: Path, src: str, ops: list[dict[str, Any]]) -> None:
    for op in ops:
        kind = op["op"]
        if kind == "json":
            _edit_json(root, op["edits"], op["fix"])
        elif kind == "flip":
            p = _pick(root, op["file"])
            buf = bytearray(p.read_bytes())
            if buf:
                i = op["at"] % len(buf)
                buf[i] ^= 1 << op["bit"]
                p.write_bytes(bytes(buf))
        elif kind == "truncate":
            p = _pick(root, op["file"])
            size = p.stat().st_size
            os.truncate(p, op["to"] % max(size, 1))
        elif kind == "extend":
            p = _pick(root, op["file"])
            with open(p, "ab") as f:
                f.write(b"\x5a" * op["n"])
        elif kind.startswith("rec_"):
            _record_op(root, op)
        elif kind == "fix_record_crcs":
            _fix_record_crcs(root)
        elif kind == "fifo":
            p = _pick(root, op["file"])
            p.unlink()
            os.mkfifo(p)
            _FIFOS.append(p)
        elif kind == "symlink_file":  # a data file replaced by a link to the decoy's
            p = _pick(root, op["file"])
            rel = p.relative_to(root).as_posix()
            p.unlink()
            decoy = sorted((outside / src / "data").iterdir())
            own = _files(root)["data"] + [rel]
            target = decoy[sorted(own).index(rel) % len(decoy)]
            os.symlink(target, p)
        elif kind == "symlink_dir":  # data/ replaced by a link to a directory outside
            shutil.rmtree(root / "data")
            os.symlink(outside / src / "as_data", root / "data")
        elif kind == "foreign_file":  # the same-named file of another save of the layout
            p = _pick(root, op["file"])
            sub = "as_data" if op["file"].startswith("data") else "as_index"
            shutil.copy(outside / src / sub / p.name, p)
        elif kind == "base":
            _base_op(root.parent, outside / src, op["do"])
        elif kind == "symlink_manifest":
            (root / "manifest.json").unlink()
            os.symlink(outside / src / "manifest.json", root / "manifest.json")
        else:
            raise ValueError(kind)


BASE = "incbase"  # the base the incremental source refers to (tests/test_mutations.py)


def _base_op(parent: Path, outside: Path, do: str) -> None:
    """Damage the referenced checkpoint beside the copy (`outside`: see prepare_outside_base)."""
    base = parent / BASE
    if do == "symlink_outside":
        shutil.rmtree(base)
        os.symlink(outside / "base_copy", base)
    elif do == "symlink_inside":
        base.rename(parent / f"{BASE}-real")
        os.symlink(parent / f"{BASE}-real", base)
    elif do == "unmanifest":
        (base / "manifest.json").unlink()
    elif do == "garbage":
        (base / "manifest.json").write_bytes(b'{"format": "snapshard", "vers')
    elif do == "staging":
        base.rename(parent / f"{BASE}.snapshard-tmp")
    elif do == "foreign_data":
        for f in sorted((base / "data").iterdir()):
            shutil.copy(outside / "base_as_data" / f.name, f)
    elif do == "no_base":
        shutil.rmtree(base)
    else:
        raise ValueError(do)


def _fresh_bases(ckpt: Path, bases: dict[str, str]) -> None:
    """Pristine copies of the checkpoints a source refers to, beside its copy."""
    for name, path in bases.items():
        for left in (name, f"{name}-real", f"{name}.snapshard-tmp"):
            p = ckpt.parent / left
            if p.exists() or p.is_symlink():
                _rmtree(p)
        shutil.copytree(path, ckpt.parent / name, symlinks=True)


# ---- running one mutation --------------------------------------------------------------


def classify(result: Any, ref: Any, decoy: Any) -> str:
    c = canon(result)
    if c == ref:
        return "identical"
    got = leaves_of(c)
    if any(x == ("str", SENTINEL) for x in got):
        return "outside"
    if decoy is not None:
        want, bad = leaves_of(ref), leaves_of(decoy)
        if len(got) == len(want) == len(bad) and any(
            _tainted(g, w, b) for g, w, b in zip(got, want, bad, strict=True)
        ):
            return "outside"
    return "different"


def _tainted(got: Any, want: Any, decoy: Any) -> bool:
    """Whether a loaded leaf holds bytes of the decoy where they differ from the original."""
    if got == decoy:
        return got != want
    blobs = [next((v for v in x if isinstance(v, bytes)), None) for x in (got, want, decoy)]
    if not all(isinstance(b, bytes) for b in blobs) or len({len(b) for b in blobs}) != 1:
        return False
    g, w, d = (np.frombuffer(b, np.uint8) for b in blobs)
    return bool(np.any((g == d) & (d != w)))


def step(fn: Any) -> tuple[str, Any]:
    """Run fn under the time cap: ("ok", value) or (class, detail)."""
    signal.setitimer(signal.ITIMER_REAL, CAP_S)
    try:
        return "ok", fn()
    except Hang:
        return "hang", f"no answer within {CAP_S} s"
    except SnapshardError as e:
        return "error", f"{type(e).__name__}: {str(e)[:300]}"
    except BaseException as e:
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        return "other", f"{type(e).__name__}: {str(e)[:300]} | {''.join(tb[-3:])[:800]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_one(
    m: dict[str, Any], ckpt: Path, refs: dict[str, Any], job: dict[str, Any]
) -> dict[str, Any]:
    outside = Path(job["outside"])
    src = m["src"]
    ref, ref_t, decoy, decoy_t, target = refs[src]
    _FIFOS.clear()
    if ckpt.exists() or ckpt.is_symlink():
        _rmtree(ckpt)
    shutil.copytree(job["sources"][src], ckpt, symlinks=True)
    _fresh_bases(ckpt, job.get("bases", {}).get(src, {}))
    out: dict[str, Any] = {"id": m["id"]}
    try:
        apply(ckpt, outside, src, m["ops"])
    except Exception as e:
        out["outcomes"] = {"apply": ["skip", f"{type(e).__name__}: {e}"]}
        return out
    outcomes: dict[str, Any] = {}
    for name, tgt, r, dc in (("load", None, ref, decoy), ("load_target", target, ref_t, decoy_t)):
        if name == "load_target" and outcomes["load"][0] == "hang":
            outcomes[name] = ["hang", "not tried: the load without a target hung"]
            continue
        cls, v = step(lambda tgt=tgt: snapshard.load(ckpt, tgt))
        if cls == "ok":
            cls, v = step(lambda v=v, r=r, dc=dc: classify(v, r, dc))
            if cls == "ok":
                cls, v = v, None
        outcomes[name] = [cls, v]
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        cls, v = step(lambda: cli(["verify", str(ckpt)]))
    if cls == "ok":
        cls, v = (
            ("verify_ok" if v == 0 else "verify_damaged" if v == 1 else "other"),
            f"exit {v}: {sink.getvalue()[-300:]}",
        )
    outcomes["verify"] = [cls, v]
    out["outcomes"] = outcomes
    return out


def _rmtree(p: Path) -> None:
    if p.is_symlink() or not p.is_dir():
        p.unlink()
    else:
        for child in list(p.iterdir()):
            _rmtree(child)
        p.rmdir()


def main() -> None:
    jobs, results = Path(sys.argv[1]), Path(sys.argv[2])
    job = json.loads(jobs.read_text())
    signal.signal(signal.SIGALRM, _on_alarm)
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    refs: dict[str, Any] = {}
    for name, path in job["sources"].items():
        plain = snapshard.load(path)
        target = target_of(plain, mesh)
        decoy = job.get("decoys", {}).get(name)
        refs[name] = (
            canon(plain),
            canon(snapshard.load(path, target)),
            canon(snapshard.load(decoy)) if decoy else None,
            canon(snapshard.load(decoy, target)) if decoy else None,
            target,
        )
    # The address-space limit: what the process holds now plus MEMORY (JAX reserves much
    # virtual memory at start-up).
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + MEMORY, vm + MEMORY))
    work = Path(tempfile.mkdtemp(prefix="mut-", dir=job.get("scratch")))
    with results.open("a") as out:
        for m in job["mutations"]:
            out.write(json.dumps({"start": m["id"]}) + "\n")
            out.flush()
            r = run_one(m, work / "ckpt", refs, job)
            out.write(json.dumps(r) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
