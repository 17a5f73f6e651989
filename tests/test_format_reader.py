"""A reader of format v2 written only from docs/format.md, with json, NumPy, ml_dtypes and
crc32c: no snapshard imports in the reader itself."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import crc32c
import ml_dtypes
import numpy as np
import pytest

from snapshard import SaveOptions

# ---- the independent reader -----------------------------------------------------------


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _value(v: dict):
    t = v["type"]
    return {
        "none": lambda: None,
        "bool": lambda: v["value"],
        "int": lambda: int(v["value"]),
        "float": lambda: float.fromhex(v["value"]),
        "str": lambda: v["value"],
        "bytes": lambda: base64.b64decode(v["value"]),
    }[t]()


def read_checkpoint(directory: Path):
    try:
        import zstandard
    except ImportError:  # only compressed checkpoints need it
        zstandard = None

    raw = (directory / "manifest.json").read_bytes()
    doc = json.loads(raw)
    assert doc["format"] == "snapshard" and doc["version"] in (2, "2.1", "2.2")
    bound = doc["version"] in ("2.1", "2.2")  # checksums keyed by file name and chunk offset

    def name_key(name: str) -> int:
        return crc32c.crc32c(name.encode()) if bound else 0

    def chunk_key(name: str, offset: int) -> int:
        mix = ((offset * 0x9E3779B97F4A7C15) % 2**64) >> 32
        return name_key(name) ^ mix if bound else 0

    at = raw.index(b'"checksum":"') + len(b'"checksum":"')
    assert crc32c.crc32c(raw[:at] + b"00000000" + raw[at + 8 :]) == int(doc["checksum"], 16)
    procs = doc["processes"]
    nonces = [procs["nonce"][8 * p : 8 * p + 8] for p in range(doc["process_count"])]
    leaves = doc["leaves"]

    def runs(pairs: list, step: int) -> list[int]:
        return [first + step * k for first, count in pairs for k in range(count)]

    # 2.2: which manifest leaf each process's own leaf i is (2.1: every leaf, in order)
    if "trees" in procs:
        trees = [runs(t, 1) for t in procs["trees"]]
        own = [trees[t] for t in runs(procs["tree_of"], 0)]
    else:
        own = [list(range(len(leaves)))] * len(nonces)
    # Every record of every process (a reader at scale fetches only the entries it needs).
    chunks: dict[int, list[tuple[int, dict]]] = {}
    for p, nonce in enumerate(nonces):
        record_name = f"index/p{p:05d}-{nonce}.idx"
        rec = (directory / record_name).read_bytes()
        assert rec[:8] == b"SNAPIDX2"
        assert crc32c.crc32c(rec) == int(procs["record_crc32c"][8 * p : 8 * p + 8], 16)
        directory_at = int.from_bytes(rec[24:32], "little")
        for i, a in enumerate(own[p]):
            entry = leaves[a]
            e = directory_at + 16 * i
            offset, count, check = struct.unpack_from("<QII", rec, e)
            if not count:
                continue
            nd = len(entry["shape"])
            size = 40 + 16 * nd
            segment = rec[offset : offset + count * size]
            salt = crc32c.crc32c(struct.pack("<II", p, i), name_key(record_name))
            assert crc32c.crc32c(segment, salt) == check
            for r in range(count):
                f = struct.unpack_from(f"<IIQQIIQ{nd}q{nd}q", segment, r * size)
                names = ("file", "flags", "offset", "nbytes", "block", "nblocks", "crc_offset")
                c = dict(zip(names, f[:7], strict=True))
                c["start"], c["stop"] = list(f[7 : 7 + nd]), list(f[7 + nd :])
                chunks.setdefault(a, []).append((p, c))

    def leaf(a: int, entry: dict):
        if entry["kind"] == "value":
            return _value(entry["value"])
        dt = _dtype(entry["dtype"])
        out = np.zeros(entry["shape"], dt)
        for p, c in chunks.get(a, []):
            if c["flags"] & 1:  # a reference: a file of a sibling checkpoint
                ref = doc["refs"][c["file"]]
                name = ref["file"]
                data = (directory.parent / ref["checkpoint"] / name).read_bytes()
            else:
                name = f"data/p{p:05d}-{nonces[p]}-{c['file']}.bin"
                data = (directory / name).read_bytes()
            key = chunk_key(name, c["offset"])
            codec = (c["flags"] >> 8) & 0xFF
            n, blk = c["nblocks"], c["block"]
            if codec:  # every block compressed on its own; offsets, then crcs of plain blocks
                offs = np.frombuffer(data, "<u8", n + 1, c["crc_offset"]).tolist()
                crcs = np.frombuffer(data, "<u4", n, c["crc_offset"] + 8 * (n + 1))
                itemsize = dt.itemsize
                pieces = []
                for b in range(n):
                    z = data[c["offset"] + offs[b] : c["offset"] + offs[b + 1]]
                    plain = np.frombuffer(zstandard.ZstdDecompressor().decompress(z), np.uint8)
                    if codec == 2 and itemsize > 1:
                        plain = plain.reshape(itemsize, -1).T.reshape(-1)
                    pieces.append(plain.tobytes())
                body = b"".join(pieces)
            else:
                body = data[c["offset"] : c["offset"] + c["nbytes"]]
                crcs = np.frombuffer(data, "<u4", n, c["crc_offset"])
            assert len(body) == c["nbytes"] and blk > 0
            for b, want in enumerate(crcs.tolist()):
                assert crc32c.crc32c(body[b * c["block"] : (b + 1) * c["block"]]) ^ key == want
            box = tuple(slice(a, b) for a, b in zip(c["start"], c["stop"], strict=True))
            shape = [b - a for a, b in zip(c["start"], c["stop"], strict=True)]
            out[box] = np.frombuffer(body, dt).reshape(shape)
        return out[()] if entry["kind"] == "scalar" else out

    def build(node: dict):
        t = node["t"]
        if t == "leaf":
            return leaf(node["i"], leaves[node["i"]])
        kids = [build(c) for c in node["c"]]
        if t in ("dict", "namedtuple", "node"):
            return dict(zip(node["k"], kids, strict=True))
        return kids if t == "list" else tuple(kids)

    return build(doc["tree"])


# ---- the test ---------------------------------------------------------------------------


def test_a_reader_written_from_the_format_document_reads_a_sharded_checkpoint(ckpt):
    import jax

    import snapshard

    from conftest import mesh, sharded

    m = mesh(2, 4)
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 32), dtype=np.float32)
    e = rng.standard_normal((16, 8), dtype=np.float32).astype(ml_dtypes.bfloat16)
    tree = {
        "params": {"w": sharded(w, m, None, "model"), "e": sharded(e, m, "data", "model")},
        "key": jax.random.key(9),
        "opt": (np.int32(3), [1.5, None, "adam", True, 2**65, b"state"]),
        "big": np.arange(20000, dtype=np.int16),
    }
    snapshard.save(ckpt, tree)
    got = read_checkpoint(ckpt)
    assert got["params"]["w"].tobytes() == w.tobytes()
    assert got["params"]["e"].tobytes() == e.tobytes()
    assert got["key"].tolist() == np.asarray(jax.random.key_data(tree["key"])).tolist()
    assert got["opt"] == (np.int32(3), [1.5, None, "adam", True, 2**65, b"state"])
    assert np.array_equal(got["big"], tree["big"])


def test_the_reader_follows_references_and_decompresses_blocks(tmp_path):
    import snapshard

    pytest.importorskip("zstandard")
    rng = np.random.default_rng(6)
    frozen = {"w": rng.standard_normal((300, 70), dtype=np.float32),
              "ids": np.arange(50_000, dtype=np.int64) % 7}  # fmt: skip
    one = {**frozen, "t": np.zeros(5)}
    snapshard.save(
        tmp_path / "1", one, options=SaveOptions(hashes=True, compression="zstd+shuffle")
    )
    two = {**frozen, "t": np.ones(5)}
    snapshard.save(
        tmp_path / "2", two, base=tmp_path / "1", options=SaveOptions(compression="zstd")
    )
    snapshard.save(tmp_path / "3", {**frozen, "t": np.ones(5)}, base=tmp_path / "2")
    got = read_checkpoint(tmp_path / "3")
    assert got["w"].tobytes() == frozen["w"].tobytes()
    assert np.array_equal(got["ids"], frozen["ids"]) and np.array_equal(got["t"], np.ones(5))


@pytest.mark.parametrize("version", ["v2_0", "v2_1"])
def test_the_reader_reads_both_minor_versions_of_the_golden_corpus(version):
    import snapshard

    pytest.importorskip("zstandard")
    golden = Path(__file__).parent / "golden" / version
    for name in ("single", "compressed", "incremental/step"):
        got = read_checkpoint(golden / name)
        want = snapshard.load(golden / name, None)
        assert got["host"].keys() == want["host"].keys()
        for k, v in want["host"].items():
            if not isinstance(v, np.ndarray):
                continue
            assert np.asarray(got["host"][k]).tobytes() == np.asarray(v).tobytes(), (name, k)
        for k, v in want["sharded"].items():
            assert np.asarray(got["sharded"][k]).tobytes() == np.asarray(v).tobytes(), (name, k)


def test_the_reader_follows_the_leaf_map_of_trees_that_differ(tmp_path, monkeypatch):
    """Format 2.2: two processes (threads here, over one store) save different keys."""
    pytest.importorskip("torch")
    import threading

    from snapshard import SaveOptions, saving
    from snapshard.coordination.base import SingleProcessCoordinator
    from snapshard.torch.saving import TorchAdapter

    class Rank(SingleProcessCoordinator):
        def __init__(self, shared: SingleProcessCoordinator, rank: int) -> None:
            super().__init__()
            self._kv, self._cond = shared._kv, shared._cond
            self.process_index, self.process_count = rank, 2

    shared = SingleProcessCoordinator()
    # (one process here: the save's namespace, numbered per process, is the same for both)
    monkeypatch.setattr(
        saving.blocking, "namespace", lambda kind, where: f"snapshard/{kind}/test/0"
    )
    states = [
        {"layers.0": np.arange(6, dtype=np.float32).reshape(2, 3), "step": 7, "shared": np.ones(4)},
        {"layers.1": np.arange(8, dtype=np.int16), "step": 7, "shared": np.ones(4)},
    ]
    errors = []

    def save(rank: int) -> None:
        adapter = TorchAdapter(None, trees_differ=True)
        adapter.rank = rank
        try:
            prep = saving.prepare(
                tmp_path / "ck", states[rank], SaveOptions(trees_differ=True),
                coordinator=Rank(shared, rank), adapter=adapter,
            )  # fmt: skip
            saving.finish(prep)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=save, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    got = read_checkpoint(tmp_path / "ck")
    assert json.loads((tmp_path / "ck" / "manifest.json").read_text())["version"] == "2.2"
    assert set(got) == {"layers.0", "layers.1", "step", "shared"}
    np.testing.assert_array_equal(got["layers.0"], states[0]["layers.0"])
    np.testing.assert_array_equal(got["layers.1"], states[1]["layers.1"])
    assert got["step"] == 7
    import snapshard

    want = snapshard.load(tmp_path / "ck", None)  # the library agrees
    np.testing.assert_array_equal(want["layers.1"], got["layers.1"])
