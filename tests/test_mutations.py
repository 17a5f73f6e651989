"""Mutation suite: damaged checkpoints (format v2 and the v1 golden corpus) must fail cleanly.

Mutations are drawn with hypothesis (derandomized, a fixed number of examples): JSON edits
of manifest.json (with its self-checksum recomputed, so that the deeper checks run, or left
stale), binary edits of record and data files, FIFOs and symlinks. Each one is applied to a
fresh copy in a subprocess (tests/workers/mutate.py, batches of mutations to amortise JAX's
start-up) under an address-space limit and a time cap per step, and the copy is loaded
without a target, loaded onto shardings and run through `snapshard verify`.

Outcomes: a SnapshardError, or data identical to the original's, are fine. Data that differs
without an error is a failure unless the edit makes another valid checkpoint (a recomputed
checksum over a changed Python value, say): such edits are marked `free` and only checked
for crashes, hangs and outside reads. Reading the decoy placed outside the checkpoint (files
with other values, a manifest with a sentinel value) is a failure. Run with -s for the table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import snapshard
from snapshard.checksum import crc32c

HERE = Path(__file__).parent
WORKER = HERE / "workers" / "mutate.py"
GOLDEN = HERE / "golden" / "v1"
V1 = {
    "v1single": GOLDEN / "single",
    "v1multi": GOLDEN / "multiprocess",
    "v1mgr": GOLDEN / "manager" / "100",
}
SENTINEL = "outside-the-checkpoint"
BATCH = 30
WORKERS = 2
EXAMPLES = {"json": 160, "binary": 130}
SPECIAL = ("fifo", "symlink", "binding")  # classes that need storage to refuse what it opens
# Format 2.x sources: a full save, a zstd+shuffle one and an incremental one whose refs name
# its base BASE, a sibling (each mutation gets fresh copies of both, side by side).
V2 = ("v2", "zstd", "inc")
BASE = "incbase"

HOSTILE: list[Any] = [
    10**30, 2**63, 2**64 + 1, -1, 0, 1, -(2**63) - 1, None, True, "x", "", 1.5, float("nan"),
    [], {}, [10**12], [-1], ["x"], [10**12, 10**12], {"t": "leaf", "i": 0}, "ffffffff",
]  # fmt: skip
VALID_ALTERNATIVES = {
    "dtype": ["float32", "int32", "uint8", "float64", "bfloat16", "int4", "complex64", "nope"],
    "kind": ["array", "scalar", "prng_key", "value", "nope"],
    "t": ["dict", "list", "tuple", "leaf", "node", "namedtuple"],
    "key_impl": ["rbg", "threefry2x32", "unsafe_rbg", "nope"],
    "type": ["int", "str", "bytes", "float", "bool", "none"],
}


def tree() -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(7)

    def put(x: np.ndarray, *spec: Any) -> jax.Array:
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    return {
        "params": {
            "w": put(rng.standard_normal((16, 8), dtype=np.float32), "data", "model"),
            "b": put(rng.integers(-9, 9, (8,), dtype=np.int32), "model"),
            "e": put(rng.standard_normal((8, 4)).astype(jax.numpy.bfloat16), None, "model"),
            "r": put(rng.standard_normal((4,), dtype=np.float32)),
        },
        "host": {"m": rng.standard_normal((5, 3)), "u": np.arange(7, dtype=np.uint16)},
        "s": np.float32(2.5),
        "key": jax.random.key(3),
        "py": [1, 2.25, "hello", None, True, b"\x00\x01", {"deep": {"er": [7, (8, 9)]}}],
    }


def decoy_of(t: dict[str, Any]) -> dict[str, Any]:
    """The same tree with every array's values changed (same shapes, shardings, dtypes)."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key(99)
        if isinstance(x, jax.Array):
            return jax.device_put(np.asarray(x) + np.asarray(1, x.dtype), x.sharding)
        if isinstance(x, np.ndarray | np.generic):
            return x + np.asarray(1, x.dtype)
        return x

    return jax.tree_util.tree_map(one, t, is_leaf=lambda x: isinstance(x, jax.Array))


def with_checksum(raw: bytes) -> bytes:
    key = b'"checksum":"'
    at = raw.find(key)
    if at < 0:
        return raw
    at += len(key)
    crc = crc32c(raw[:at] + b"00000000" + raw[at + 8 :])
    return raw[:at] + f"{crc:08x}".encode() + raw[at + 8 :]


def sentinel_manifest(src: Path) -> bytes:
    """The manifest of `src` with its last Python value replaced by the str SENTINEL."""
    doc = json.loads((src / "manifest.json").read_bytes())
    leaf = [x for x in doc["leaves"] if x["kind"] == "value"][-1]
    leaf["value"] = {"type": "str", "value": SENTINEL}
    return with_checksum(json.dumps(doc, separators=(",", ":")).encode())


def prepare_outside(name: str, src: Path, decoy: Path | None, outside: Path) -> None:
    """What a followed symlink would read: the decoy's data files (under their own names
    and, in as_data/, under the names of `src`'s files) and a sentinel manifest. v1 has no
    decoy save: its stand-ins are `src`'s files with every byte changed."""
    d = outside / name
    (d / "data").mkdir(parents=True)
    (d / "as_data").mkdir()
    (d / "as_index").mkdir()
    own = sorted((src / "data").iterdir())
    if decoy is not None:
        theirs = sorted((decoy / "data").iterdir())
        for f in theirs:
            shutil.copy(f, d / "data" / f.name)
    else:
        theirs = []
        for f in own:
            (d / "data" / f.name).write_bytes(bytes(b ^ 0x5A for b in f.read_bytes()))
        theirs = sorted((d / "data").iterdir())
    for mine, other in zip(own, theirs, strict=True):
        shutil.copy(other, d / "as_data" / mine.name)
    (d / "manifest.json").write_bytes(sentinel_manifest(src))


def prepare_outside_base(base: Path, decoy: Path, outside: Path) -> None:
    """For the incremental source: a copy of its base (`base_copy/`, what a symlinked base
    would lead to) and the decoy base's data files under the base's names (`base_as_data/`)."""
    shutil.copytree(base, outside / "base_copy")
    (outside / "base_as_data").mkdir()
    mine, theirs = sorted((base / "data").iterdir()), sorted((decoy / "data").iterdir())
    for m, o in zip(mine, theirs, strict=True):
        assert m.stat().st_size == o.stat().st_size
        shutil.copy(o, outside / "base_as_data" / m.name)


def only(directory: Path) -> Path:
    (f,) = directory.iterdir()
    return f


# ---- drawing mutations ---------------------------------------------------------------------


def json_paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((*prefix, k))
            out.extend(json_paths(v, (*prefix, k)))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:6]):  # the first few elements of long lists
            out.append((*prefix, i))
            out.extend(json_paths(v, (*prefix, i)))
    return out


def get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def itemsize(name: Any) -> int | None:
    from snapshard.dtypes import NAME_TO_DTYPE

    dt = NAME_TO_DTYPE.get(name) if isinstance(name, str) else None
    return None if dt is None else dt.itemsize


def is_free(doc: Any, e: dict[str, Any]) -> bool:
    """Whether an edit (with a valid checksum) may make another valid checkpoint."""
    paths = [tuple(e[k]) for k in ("path", "a", "b") if k in e]
    if e["e"] == "swap" and len(paths) == 2 and paths[0][-1] == paths[1][-1] == "dtype":
        return itemsize(get(doc, paths[0])) == itemsize(get(doc, paths[1]))
    for path in paths:
        if path[:1] in (("created_unix",), ("write_mode",), ("extra",)):
            return True
        if len(path) >= 3 and path[0] == "leaves" and path[2] == "sharding":
            return True
        if len(path) == 4 and path[0] == "leaves" and path[2:] == ("value", "value"):
            return True
        if e["e"] == "set" and "value" in e:
            last, v = path[-1], e["value"]
            if path[0] == "leaves" and last == "dtype":
                return itemsize(v) is not None and itemsize(v) == itemsize(get(doc, path))
            if last in ("kind", "t", "type", "name") and v in VALID_ALTERNATIVES.get(last, [v]):
                return True
    return False


def major(doc: Any) -> int:
    """The major format version of a manifest (2.0 is `2`, 2.1 is `"2.1"`)."""
    return 1 if doc["version"] == 1 else 2


def json_edit(doc: Any, version: int) -> st.SearchStrategy[dict[str, Any]]:
    paths = json_paths(doc)
    lists = [p for p in paths if isinstance(get(doc, p[:-1]), list)]
    dicts = [p for p in paths if isinstance(get(doc, p), dict) and get(doc, p)]
    shapes = [p for p in paths if p[-1] == "shape"]
    dtypes = [p for p in paths if p[-1] == "dtype"]
    leaves = [p for p in paths if len(p) == 2 and p[0] == "leaves"]
    tree_nodes = [p for p in paths if p[:1] == ("tree",) and isinstance(get(doc, p), dict)]
    named = [p for p in paths if p[-1] in VALID_ALTERNATIVES]
    values = st.sampled_from(HOSTILE)
    pjson = st.sampled_from(paths).map(list)

    def alt(p: tuple[Any, ...]) -> st.SearchStrategy[dict[str, Any]]:
        return st.sampled_from(VALID_ALTERNATIVES[p[-1]]).map(
            lambda v: {"e": "set", "path": list(p), "value": v}
        )

    nonce_edits = []
    if version >= 2:
        nonce = doc["processes"]["nonce"]
        nonce_edits = [
            {"e": "set", "path": ["processes", "nonce"], "value": v}
            for v in (
                nonce[:-1] + ("0" if nonce[-1] != "0" else "1"),
                nonce.upper(),
                nonce[:-1],
                "",
            )
        ]
    return st.one_of(
        st.builds(lambda p, v: {"e": "set", "path": p, "value": v}, pjson, values),
        st.builds(lambda p: {"e": "del", "path": p}, pjson),
        st.builds(lambda p: {"e": "dup", "path": list(p)}, st.sampled_from(lists)),
        st.builds(
            lambda a, b: {"e": "swap", "a": list(a), "b": list(b)},
            st.sampled_from(leaves), st.sampled_from(leaves),
        ),
        st.builds(
            lambda a, b: {"e": "swap", "a": list(a), "b": list(b)},
            st.sampled_from(dtypes), st.sampled_from(dtypes),
        ),
        st.builds(
            lambda p, k, v, f: {"e": "dupkey", "path": list(p), "key": k, "value": v, "first": f},
            st.sampled_from(dicts), st.integers(0, 20), values, st.booleans(),
        ),
        st.builds(lambda p: {"e": "double_shape", "path": list(p)}, st.sampled_from(shapes)),
        st.builds(
            lambda p, d: {"e": "set", "path": list(p), "depth": d, "style": "tree"},
            st.sampled_from(tree_nodes), st.sampled_from([300, 2000]),
        ),
        st.builds(
            lambda p, d: {"e": "set", "path": p, "depth": d, "style": "list"},
            st.sampled_from([["extra"], ["leaves"], ["tree"]]),
            st.sampled_from([100_000]),
        ),
        st.sampled_from(named).flatmap(alt),
        *([st.sampled_from(nonce_edits)] if nonce_edits else []),
    )  # fmt: skip


def named_edits(docs: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The damage of the issue's findings, spelled out (hypothesis may not draw each)."""
    out: list[tuple[str, list[dict[str, Any]]]] = []
    for name, doc in docs.items():
        arrays = [i for i, x in enumerate(doc["leaves"]) if x["kind"] != "value" and x["shape"]]
        a = max(
            arrays,
            key=lambda i: (
                len(doc["leaves"][i].get("chunks", [])) or doc["leaves"][i].get("chunk_count", 0)
            ),
        )
        leaf = ["leaves", a]
        edits = [
            {"e": "set", "path": [*leaf, "shape"], "value": [10**12]},
            {
                "e": "set",
                "path": [*leaf, "shape"],
                "value": [10**12] * len(doc["leaves"][a]["shape"]),
            },
            {"e": "set", "path": [*leaf, "shape", 0], "value": 10**30},
            {"e": "set", "path": [*leaf, "shape", 0], "value": 2**63},
            {"e": "set", "path": [*leaf, "shape", 0], "value": -1},
            {"e": "double_shape", "path": [*leaf, "shape"]},
            {"e": "set", "path": [*leaf, "path"], "value": doc["leaves"][arrays[0]]["path"]},
            {"e": "dup", "path": leaf},
            {"e": "del", "path": leaf},
        ]
        keys = [i for i, x in enumerate(doc["leaves"]) if x["kind"] == "prng_key"]
        if keys:
            edits.append({"e": "set", "path": ["leaves", keys[0], "key_impl"], "value": "rbg"})
            edits.append({"e": "set", "path": ["leaves", keys[0], "shape"], "value": [4]})
        if doc["version"] == 1:
            c0 = [*leaf, "chunks", 0]
            edits += [
                {"e": "set", "path": [*leaf, "chunks"], "value": []},
                {"e": "dup", "path": c0},
                {"e": "del", "path": c0},
                {"e": "swap", "a": [*c0, "start"], "b": [*leaf, "chunks", 1, "start"]},
                {"e": "set", "path": [*c0, "offset"], "value": 10**30},
                {"e": "set", "path": [*c0, "offset"], "value": 2**63},
                {"e": "set", "path": [*c0, "nbytes"], "value": -1},
                {"e": "set", "path": [*c0, "block"], "value": 0},
                {"e": "set", "path": [*c0, "start", 0], "value": 2**63},
                {
                    "e": "set",
                    "path": [*c0, "crc32c"],
                    "value": "zz" + doc["leaves"][a]["chunks"][0]["crc32c"][2:],
                },
                {"e": "set", "path": ["files", 0, "size"], "value": 10**30},
                {"e": "set", "path": ["files", 0, "name"], "value": "../manifest.json"},
            ]
        else:
            edits += [
                {"e": "set", "path": [*leaf, "chunk_count"], "value": 0},
                {"e": "set", "path": [*leaf, "chunk_count"], "value": 10**30},
                {"e": "set", "path": [*leaf, "layout"], "value": 2**63},
                {"e": "set", "path": [*leaf, "writers"], "value": [2**63]},
                {"e": "set", "path": ["processes", "data_sizes", 0, 0], "value": 10**30},
                {"e": "set", "path": ["processes", "record_sizes", 0], "value": 2**63},
                {"e": "set", "path": ["process_count"], "value": 10**30},
                {"e": "set", "path": ["meshes", 0, "shape", 0], "value": 2**63},
                # issue 36: strict JSON types and values, decoding errors naming the leaf
                {"e": "set", "path": ["version"], "value": 2.0},
                {"e": "set", "path": ["version"], "value": 2},  # 2.1's checksums read as 2.0
                {"e": "set", "path": ["version"], "value": True},
                {"e": "set", "path": ["process_count"], "value": True},
                {"e": "set", "path": ["total_bytes"], "value": -5},
                {"e": "set", "path": [*leaf, "kind"], "value": "per_process"},
                *(
                    {"e": "set", "path": [*leaf, "dtype"], "value": v}
                    for v in ("object", "float128", "<i1")
                ),
            ]
            if keys:
                edits.append(
                    {"e": "set", "path": ["leaves", keys[0], "key_impl"], "value": "bogus"}
                )
            used = [k for k, r in enumerate(doc.get("refs", [])) if r]
            if used:
                ref = ["refs", used[0]]
                edits += [
                    {"e": "set", "path": [*ref, "checkpoint"], "value": BASE + "\n"},
                    {"e": "set", "path": [*ref, "checkpoint"], "value": "nothere"},
                    {"e": "set", "path": [*ref, "size"], "value": doc["refs"][used[0]]["size"] + 1},
                    {
                        "e": "set",
                        "path": [*ref, "file"],
                        "value": doc["refs"][used[0]]["file"][:-5] + "9.bin",
                    },
                ]
        out += [(name, [e]) for e in edits]
    return out


def draw_all(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """n distinct examples of `strategy`, the same on every run."""
    out: dict[str, Any] = {}

    @settings(
        max_examples=n, derandomize=True, database=None, deadline=None,
        suppress_health_check=list(HealthCheck), phases=["generate"],
    )  # fmt: skip
    @given(strategy)
    def collect(x: Any) -> None:
        out.setdefault(json.dumps(x, sort_keys=True, default=str), x)

    collect()
    return list(out.values())


def json_mutations(docs: dict[str, Any]) -> list[dict[str, Any]]:
    per = {
        name: st.tuples(
            st.just(name),
            st.lists(json_edit(doc, major(doc)), min_size=1, max_size=2),
            st.booleans() if major(doc) >= 2 else st.just(True),
            st.sampled_from([0, 1, 1, 1]),  # mostly a recomputed checksum
        )
        for name, doc in docs.items()
    }
    strategy = st.one_of(per["v2"], per["v2"], per["v2"], *(v for k, v in per.items() if k != "v2"))
    out = []
    drawn = draw_all(strategy, EXAMPLES["json"])
    drawn += [(name, edits, True, 1) for name, edits in named_edits(docs)]
    for name, edits, fix, weight in drawn:
        fix = fix if docs[name]["version"] == 1 else bool(weight)
        free = fix and any(is_free(docs[name], e) for e in edits)
        out.append({
            "src": name, "cls": "json" if fix else "json-stale-checksum", "free": free,
            "ops": [{"op": "json", "edits": edits, "fix": fix}],
        })  # fmt: skip
    return out


def binary_mutations(docs: dict[str, Any]) -> list[dict[str, Any]]:
    files = st.sampled_from(["data:0", "data:1", "data:2", "index:0", "manifest"])
    byte = st.integers(0, 1 << 20)
    raw = st.one_of(
        st.builds(lambda f, a, b: [{"op": "flip", "file": f, "at": a, "bit": b}], files, byte, st.integers(0, 7)),
        st.builds(lambda f, t: [{"op": "truncate", "file": f, "to": t}], files, byte),
        st.builds(lambda f, n: [{"op": "extend", "file": f, "n": n}], files, st.sampled_from([1, 7, 4096])),
    )  # fmt: skip
    big = st.sampled_from([2**32 - 1, 2**31, 2**63, 2**64 - 1, 0, 1, 1 << 40, 63])
    records = st.one_of(
        st.builds(
            lambda a, f, v: [{"op": "rec_entry", "leaf": a, "field": f, "value": v}],
            st.integers(0, 30), st.sampled_from(["offset", "count", "crc"]),
            st.one_of(big, st.just("other")),
        ),
        st.builds(lambda a: [{"op": "rec_swap", "leaf": a}], st.integers(0, 30)),
        st.builds(
            lambda a, r, f, x, v: [{"op": "rec_field", "leaf": a, "rec": r, "field": f, "axis": x, "value": v}],
            st.integers(0, 30), st.integers(0, 8),
            st.sampled_from(["file", "flags", "offset", "nbytes", "block", "nblocks", "crc_offset", "start", "stop"]),
            st.integers(0, 3), st.one_of(big, st.integers(-3, 20)),
        ),
        st.builds(lambda a, r: [{"op": "rec_dup_record", "leaf": a, "rec": r}], st.integers(0, 30), st.integers(0, 8)),
        st.builds(lambda a: [{"op": "rec_count", "leaf": a}], st.integers(0, 30)),
    )  # fmt: skip
    v2 = st.tuples(st.sampled_from(V2), st.one_of(raw, records, records), st.booleans())
    v1 = st.tuples(st.sampled_from(sorted(V1)), raw, st.just(False))
    out = []
    for name, ops, fix in draw_all(st.one_of(v2, v2, v1), EXAMPLES["binary"]):
        is_record = ops[0]["op"].startswith("rec_") or ops[0].get("file") == "index:0"
        if fix and name in V2 and is_record:
            ops = [*ops, {"op": "fix_record_crcs"}]
        out.append(
            {"src": name, "cls": "records" if is_record else "files", "free": False, "ops": ops}
        )
    return out


def binding_mutations() -> list[dict[str, Any]]:
    """Issue 36: files of another save renamed into place, and referenced checkpoints that
    are symbolic links, not committed or hold another save's files. Every one must fail."""
    ops: list[tuple[str, list[dict[str, Any]]]] = [
        ("v2", [{"op": "foreign_file", "file": "data:0"}]),
        ("v2", [{"op": "foreign_file", "file": "data:1"}]),
        ("v2", [{"op": "foreign_file", "file": "index:0"}]),
        ("v2", [{"op": "foreign_file", "file": "index:0"}, {"op": "fix_record_crcs"}]),
        ("inc", [{"op": "foreign_file", "file": "data:0"}]),
    ]
    ops += [
        ("inc", [{"op": "base", "do": do}])
        for do in ("symlink_outside", "symlink_inside", "unmanifest", "garbage", "staging",
                   "foreign_data", "no_base")
    ]  # fmt: skip
    return [
        {"src": src, "cls": "binding", "free": False, "must_fail": True, "ops": o} for src, o in ops
    ]


def special_mutations() -> list[dict[str, Any]]:
    out = binding_mutations()
    for name in [*V2, *sorted(V1)]:
        for f in ("data:0", "index:0", "manifest"):
            out.append(
                {"src": name, "cls": "fifo", "free": False, "ops": [{"op": "fifo", "file": f}]}
            )
        for op in (
            {"op": "symlink_file", "file": "data:0"},
            {"op": "symlink_dir"},
            {"op": "symlink_manifest"},
        ):
            out.append({"src": name, "cls": "symlink", "free": False, "ops": [op]})
    return out


# ---- running them --------------------------------------------------------------------------


def run_batch(job: dict[str, Any], batch: list[dict[str, Any]], where: Path) -> dict[int, Any]:
    """Results of a batch, by mutation id; a worker that dies or stalls has its current
    mutation recorded as a hang and the rest run again in a new worker."""
    results: dict[int, Any] = {}
    todo = list(batch)
    n = 0
    while todo:
        n += 1
        jobs, out = (
            where / f"jobs-{todo[0]['id']}-{n}.json",
            where / f"results-{todo[0]['id']}-{n}.jsonl",
        )
        jobs.write_text(json.dumps({**job, "mutations": todo}))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        try:
            proc = subprocess.run(
                [sys.executable, str(WORKER), str(jobs), str(out)],
                env=env, capture_output=True, text=True, timeout=60 + 30 * len(todo),
            )  # fmt: skip
            tail = proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            tail = "worker timed out"
        started = None
        if out.exists():
            for line in out.read_text().splitlines():
                r = json.loads(line)
                if "start" in r:
                    started = r["start"]
                else:
                    results[r["id"]] = r["outcomes"]
                    started = None
        if started is not None:
            results[started] = {"worker": ["hang", f"the worker died or stalled: {tail[-500:]}"]}
        elif not out.exists() or not any(m["id"] in results for m in todo):
            raise RuntimeError(f"mutation worker failed before its first mutation:\n{tail}")
        todo = [m for m in todo if m["id"] not in results]
    return results


def verdict(m: dict[str, Any], outcomes: dict[str, Any]) -> str:
    """One class per mutation: error, identical, free, other, wrong, hang, outside, skip."""
    classes = [c for c, _ in outcomes.values()]
    if "apply" in outcomes:
        return "skip"
    if "outside" in classes:
        return "outside"
    if "hang" in classes:
        return "hang"
    if "other" in classes:
        return "other"
    loads = [outcomes[k][0] for k in ("load", "load_target") if k in outcomes]
    if "different" in loads:
        return "free" if m["free"] else "wrong"
    if m.get("must_fail") and ("error" not in loads or "verify_ok" in classes):
        return "wrong"  # a file of another save, or a base it must not read, went unnoticed
    if "verify_ok" in classes and "error" in loads:
        return "wrong"  # verify passes a checkpoint that load refuses
    return "error" if "error" in loads or "verify_damaged" in classes else "identical"


@pytest.fixture(scope="session")
def mutation_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> list[tuple[dict[str, Any], str, Any]]:
    base = tmp_path_factory.mktemp("mutations")
    t = tree()
    snapshard.save(base / "v2", t)
    snapshard.save(base / "decoy", decoy_of(t))
    snapshard.save(base / "zstd", t, options=snapshard.SaveOptions(compression="zstd+shuffle"))
    hashed = snapshard.SaveOptions(hashes=True)
    snapshard.save(base / BASE, t, options=hashed)
    snapshard.save(base / "decoybase", decoy_of(t), options=hashed)  # the base's layout
    snapshard.save(base / "inc", {**t, "s": np.float32(3.5)}, base=base / BASE)
    sources = {name: base / name for name in V2} | V1
    outside = base / "outside"
    for name, src in sources.items():
        prepare_outside(name, src, base / "decoy" if name == "v2" else None, outside)
    prepare_outside_base(base / BASE, base / "decoybase", outside / "inc")
    shutil.copy(
        only(base / "decoy" / "index"),
        outside / "v2" / "as_index" / only(base / "v2" / "index").name,
    )
    docs = {name: json.loads((src / "manifest.json").read_bytes()) for name, src in sources.items()}
    muts = json_mutations(docs) + binary_mutations(docs)
    special = special_mutations()  # spread out: their hangs cost time in every batch alike
    step = max(len(muts) // max(len(special), 1), 1)
    for k, m in enumerate(special):
        muts.insert(k * (step + 1), m)
    for i, m in enumerate(muts):
        m["id"] = i
    job = {
        "sources": {k: str(v) for k, v in sources.items()},
        "decoys": {"v2": str(base / "decoy")},
        "bases": {"inc": {BASE: str(base / BASE)}},
        "outside": str(outside),
        "scratch": str(base),
    }
    batches = [muts[i : i + BATCH] for i in range(0, len(muts), BATCH)]
    results: dict[int, Any] = {}
    with ThreadPoolExecutor(WORKERS) as pool:
        for r in pool.map(lambda b: run_batch(job, b, base), batches):
            results.update(r)
    out = [(m, verdict(m, results[m["id"]]), results[m["id"]]) for m in muts]
    print_table(out)
    return out


def print_table(out: list[tuple[dict[str, Any], str, Any]]) -> None:
    rows = ["json", "json-stale-checksum", "records", "files", "fifo", "symlink", "binding"]
    cols = ["tried", "error", "identical", "free", "other", "wrong", "hang", "outside"]
    print("\nmutation outcomes (error: clean snapshard error; identical: loads identical data; "
          "free: a valid edit; wrong: silent wrong data)")  # fmt: skip
    print(f"{'class':<21}" + "".join(f"{c:>10}" for c in cols))
    total: Counter[str] = Counter()
    for r in rows:
        c = Counter(v for m, v, _ in out if m["cls"] == r)
        c["tried"] = sum(1 for m, v, _ in out if m["cls"] == r and v != "skip")
        total.update(c)
        print(f"{r:<21}" + "".join(f"{c[k]:>10}" for k in cols))
    print(f"{'all':<21}" + "".join(f"{total[k]:>10}" for k in cols))
    loads = Counter(
        (m["src"], o[k][0])
        for m, v, o in out
        if v != "skip"
        for k in ("load", "load_target")
        if k in o
    )
    print("loads by source (error / identical / different / other):")
    for src in sorted({s for s, _ in loads}):
        print(
            f"  {src:<10}"
            + " / ".join(str(loads[(src, c)]) for c in ("error", "identical", "different", "other"))
        )
    for m, v, o in out:
        if v in ("other", "wrong", "hang", "outside"):
            print(f"  {v}: {m['cls']} {m['src']} {json.dumps(m['ops'], default=str)[:300]}")
            for step, (c, d) in o.items():
                print(f"      {step}: {c} {str(d)[:400]}")


def failures(out: list[tuple[dict[str, Any], str, Any]], classes: tuple[str, ...]) -> list[str]:
    return [
        f"{v}: {m['src']} {json.dumps(m['ops'], default=str)[:200]} -> {o}"
        for m, v, o in out
        if m["cls"] in classes and v in ("other", "wrong", "hang", "outside")
    ]


def test_mutations_fail_cleanly(mutation_results: list[Any]) -> None:
    tried = [m for m, v, _ in mutation_results if v != "skip" and m["cls"] not in SPECIAL]
    assert len(tried) > 150
    classes = ("json", "json-stale-checksum", "records", "files")
    bad = failures(mutation_results, classes)
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("cls", SPECIAL)
def test_special_files(mutation_results: list[Any], cls: str) -> None:
    bad = failures(mutation_results, (cls,))
    assert not bad, "\n".join(bad[:20])


def test_every_mutation_class_was_tried(mutation_results: list[Any]) -> None:
    kinds = Counter(op["op"] for m, v, _ in mutation_results if v != "skip" for op in m["ops"])
    for op in ("json", "flip", "truncate", "extend", "rec_entry", "rec_swap", "rec_field",
               "fifo", "symlink_file", "symlink_dir", "symlink_manifest", "foreign_file",
               "base"):  # fmt: skip
        assert kinds[op], op
    edits = Counter(
        e["e"]
        for m, *_ in mutation_results
        for op in m["ops"]
        if op["op"] == "json"
        for e in op["edits"]
    )
    for e in ("set", "del", "dup", "swap", "dupkey", "double_shape"):
        assert edits[e], e


def test_every_error_names_its_file_or_leaf(mutation_results: list[Any]) -> None:
    """A load's refusal says where: the checkpoint's path (hence the file) or the leaf."""
    unnamed = [
        f"{m['src']} {json.dumps(m['ops'], default=str)[:200]} -> {step}: {detail}"
        for m, _, o in mutation_results
        for step, (cls, detail) in o.items()
        if step in ("load", "load_target") and cls == "error"
        and "/ckpt" not in detail and "leaf" not in detail
    ]  # fmt: skip
    assert not unnamed, "\n".join(unnamed[:20])
