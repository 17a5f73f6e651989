"""The machine's limits for the bench's bytes: fsync'd sequential write with 1 and 2 threads,
warm and fadvise-evicted read of the same file, single-thread memcpy.

usage: python job_phys.py [--scale S] [--round R] [write1 write2 read read_evicted memcpy]
"""

from __future__ import annotations

import argparse
import os
import threading

import numpy as np

import common as bc

PIECE = 64 << 20  # one reused source buffer, like a writer streaming from staged memory


def write_file(path: str, nbytes: int, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(buf)
        left = nbytes
        while left:
            left -= os.write(fd, mv[: min(len(mv), left)])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str, buf: np.ndarray) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        mv = memoryview(buf)
        while n := os.readv(fd, [mv]):
            total += n
    finally:
        os.close(fd)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--round", type=int, default=0)
    ap.add_argument("modes", nargs="*", default=["write1", "read", "read_evicted", "write2"])
    args = ap.parse_args()
    nbytes = bc.payload_bytes(args.scale)  # the same bytes every library writes
    d = bc.ckpt_dir("phys")
    bc.fresh_dir(d)
    os.makedirs(d)
    buf = np.random.default_rng(0).integers(0, 255, PIECE, dtype=np.uint8)
    rbuf = np.ones(PIECE, np.uint8)
    f1 = os.path.join(d, "f1")
    try:
        for mode in args.modes:
            bc.settle()
            if mode == "write1":
                if os.path.exists(f1):
                    os.unlink(f1)
                bc.settle()
                with bc.Meter() as m:
                    write_file(f1, nbytes, buf)
                    bc.fsync_path(d)
                bc.emit(method="raw_write_1thread", bytes=nbytes, **m.as_dict("op"))
            elif mode == "write2":
                paths = [os.path.join(d, f"p{i}") for i in range(2)]
                half = [nbytes // 2, nbytes - nbytes // 2]
                with bc.Meter() as m:
                    ts = [
                        threading.Thread(target=write_file, args=(p, n, buf))
                        for p, n in zip(paths, half, strict=True)
                    ]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()
                    bc.fsync_path(d)
                bc.emit(method="raw_write_2threads", bytes=nbytes, **m.as_dict("op"))
                for p in paths:
                    os.unlink(p)
            elif mode in ("read", "read_evicted"):
                if not os.path.exists(f1):
                    write_file(f1, nbytes, buf)
                if mode == "read":
                    read_file(f1, rbuf)  # make sure it is in the page cache
                else:
                    bc.evict(f1)
                with bc.Meter() as m:
                    n = read_file(f1, rbuf)
                name = "raw_read_warm" if mode == "read" else "raw_read_evicted"
                bc.emit(method=name, bytes=n, **m.as_dict("op"))
            elif mode == "memcpy":
                src = np.ones(1 << 30, np.uint8)
                dst = np.zeros(1 << 30, np.uint8)
                np.copyto(dst, src)  # touch both first
                with bc.Meter() as m:
                    np.copyto(dst, src)
                bc.emit(method="memcpy_1GiB", bytes=1 << 30, **m.as_dict("op"))
                del src, dst
            else:
                raise SystemExit(f"unknown mode {mode}")
    finally:
        bc.remove(d)


if __name__ == "__main__":
    main()
