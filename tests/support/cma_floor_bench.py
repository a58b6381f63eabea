"""The kernel's floor for same-host reads (issue 40 item 6): what ``process_vm_readv`` itself does, with no
transport around it, for one contiguous read and for the same bytes as scattered blocks.

``taskset -c 1 .venv/bin/python -m tests.support.cma_floor_bench [--pool-mib 960] [--block-kib 32]
[--blocks 1024] [--repeats 10] [--json FILE]``

A source process holds a pool of ``--pool-mib`` (faulted in, as an engine's KV pool is); this process
reads ``--blocks`` blocks of ``--block-kib`` from it into a pool of its own, three ways, each repeat at
fresh random places (the default pool is larger than the last-level cache, so reads are cold):
one contiguous read of all the bytes; the scattered blocks in one call (one iovec per block, at most
``IOV_MAX`` a call: what a transport could do at best); one call per block (what a transport posting one
get per block pays in system calls; here each call also pays ctypes' own microsecond or two). UCX's ``cma``
transport issues one ``process_vm_readv`` per get. Prints a table (p50 per read, GB/s, ratio to the
contiguous read) and writes it as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import multiprocessing
import os
import time

import numpy as np

IOV_MAX = 1024  # Linux's UIO_MAXIOV


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _source(pool_bytes: int, address: "multiprocessing.Queue[int]", stop: "multiprocessing.synchronize.Event") -> None:
    pool = np.ones(pool_bytes // 8, dtype=np.int64)
    address.put(pool.ctypes.data)
    stop.wait()


def _iovecs(pairs: list[tuple[int, int, int]]) -> list[tuple[int, ctypes.Array, ctypes.Array]]:
    """``(local, remote, length)`` rows as the calls' iovec arrays, at most ``IOV_MAX`` rows a call (built
    before the clock starts: only the system calls are timed)."""
    calls = []
    for first in range(0, len(pairs), IOV_MAX):
        rows = pairs[first:first + IOV_MAX]
        calls.append((len(rows), (Iovec * len(rows))(*[Iovec(a, n) for a, _, n in rows]),
                      (Iovec * len(rows))(*[Iovec(b, n) for _, b, n in rows])))
    return calls


def _readv(libc: ctypes.CDLL, pid: int, calls: list[tuple[int, ctypes.Array, ctypes.Array]]) -> int:
    """Make the calls ``_iovecs`` built; the bytes copied."""
    copied = 0
    for n, local, remote in calls:
        done = libc.process_vm_readv(pid, local, n, remote, n, 0)
        if done < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        copied += done
    return copied


def run(pool_mib: int, block_kib: int, blocks: int, repeats: int, seed: int = 0) -> dict:
    pool, block = pool_mib << 20, block_kib << 10
    if blocks * block > pool:
        raise SystemExit(f"--blocks {blocks} of {block_kib} KiB do not fit a pool of {pool_mib} MiB")
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    context = multiprocessing.get_context("fork")
    address: "multiprocessing.Queue[int]" = context.Queue()
    stop = context.Event()
    source = context.Process(target=_source, args=(pool, address, stop), daemon=True)
    source.start()
    try:
        remote_base = address.get(timeout=120)
        mine = np.ones(pool // 8, dtype=np.int64)
        local_base = mine.ctypes.data
        rng = np.random.default_rng(seed)
        times: dict[str, list[float]] = {"contiguous": [], "scattered, one call": [], "scattered, a call per block": []}
        for repeat in range(repeats + 2):  # two warm-up rounds
            for mode in times:
                if mode == "contiguous":
                    at, to = (int(rng.integers(0, (pool - blocks * block) // block + 1)) * block for _ in range(2))
                    calls = _iovecs([(local_base + to, remote_base + at, blocks * block)])
                else:
                    src = rng.choice(pool // block, blocks, replace=False) * block
                    dst = rng.choice(pool // block, blocks, replace=False) * block
                    rows = [(local_base + int(d), remote_base + int(s), block) for s, d in zip(src, dst)]
                    calls = _iovecs(rows) if mode == "scattered, one call" else \
                        [call for row in rows for call in _iovecs([row])]
                began = time.perf_counter()
                copied = _readv(libc, source.pid, calls)
                elapsed = time.perf_counter() - began
                assert copied == blocks * block, copied
                if repeat >= 2:
                    times[mode].append(elapsed)
    finally:
        stop.set()
        source.join(30)
    p50 = {mode: sorted(v)[len(v) // 2] for mode, v in times.items()}
    nbytes = blocks * block
    return {"pool_mib": pool_mib, "block_kib": block_kib, "blocks": blocks, "repeats": repeats, "bytes": nbytes,
            "reads": [{"mode": mode, "p50_ms": p50[mode] * 1e3, "gb_s": nbytes / p50[mode] / 1e9,
                       "vs_contiguous": p50["contiguous"] / p50[mode]} for mode in times]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-mib", type=int, default=960)
    parser.add_argument("--block-kib", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run(args.pool_mib, args.block_kib, args.blocks, args.repeats)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"process_vm_readv of {args.blocks} x {args.block_kib} KiB from a {args.pool_mib} MiB pool")
    for column in ("read", "p50 ms", "GB/s", "vs contiguous"):
        table.add_column(column, justify="right")
    for row in result["reads"]:
        table.add_row(row["mode"], f"{row['p50_ms']:.2f}", f"{row['gb_s']:.2f}", f"{row['vs_contiguous']:.2f}x")
    Console().print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
