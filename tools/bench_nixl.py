"""Two-process NIXL pull benchmark: descriptor build time and GB/s of scattered pulls.

    PYTHONPATH=. python tools/bench_nixl.py --shape 2,32,1024,16,8,128 --blocks 512 --repeat 3

The source process registers a pool and serves its ``export_meta()``; this
process registers an equal pool and pulls ``--blocks`` random source blocks into
random destination blocks, ``--repeat`` times. Reported per pull: naive
descriptors (block x plane), coalesced rows, which path built the READ
(``prepped`` indices or Nx3 ``rows``), build time, wall time and GB/s. A few
blocks are checked byte for byte (the source pattern is cheap to recompute).
``--compare-rows`` also times the Nx3 fallback on the same plans.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import numpy as np
import torch


def _fill(pool: torch.Tensor) -> None:
    """A pattern that differs per block and plane and costs one pass to write."""
    flat = pool.view(torch.int32).view(-1)
    flat.copy_(torch.arange(flat.numel(), dtype=torch.int32))


def _serve(conn: Any, shape: tuple[int, ...], dtype: str) -> None:
    from kvxfer.backends.nixl.backend import NixlBackend

    pool = torch.empty(shape, dtype=getattr(torch, dtype))
    _fill(pool)
    t0 = time.perf_counter()
    backend = NixlBackend("bench-src", pool, shape[2])
    conn.send((backend.export_meta(), time.perf_counter() - t0))
    conn.recv()  # stop
    backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="2,32,1024,16,8,128")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compare-rows", action="store_true")
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))

    from kvxfer.backends import nixl as nixl_mod
    from kvxfer.backends.nixl.backend import NixlBackend, nixl_transport_info

    print(nixl_transport_info().summary())
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, shape, args.dtype), daemon=True)
    proc.start()
    dst = torch.zeros(shape, dtype=getattr(torch, args.dtype))
    t0 = time.perf_counter()
    backend = NixlBackend("bench-dst", dst, shape[2], timeout_s=120)
    reg_s = time.perf_counter() - t0
    meta, src_reg_s = conn.recv()
    expected = torch.empty_like(dst)
    _fill(expected)
    print(f"pool {list(shape)} {args.dtype}: {dst.numel() * dst.element_size() / 2**30:.2f} GiB per side; "
          f"registration {reg_s * 1e3:.1f} ms (decode), {src_reg_s * 1e3:.1f} ms (source)")
    rng = np.random.default_rng(0)
    paths = ["prepped", "rows"] if args.compare_rows else ["prepped"]
    aligned = nixl_mod._plan_is_slice_aligned
    for i in range(args.repeat):
        src_ids = rng.choice(shape[2], args.blocks, replace=False)
        dst_ids = rng.choice(shape[2], args.blocks, replace=False)
        for path in paths:
            nixl_mod._plan_is_slice_aligned = aligned if path == "prepped" else (lambda *a: False)
            t = time.perf_counter()
            handle = backend.begin_pull_blocks(meta, src_ids, dst_ids, request_id=f"{path}-{i}")
            posted = time.perf_counter() - t
            handle.wait()
            wall = time.perf_counter() - t
            gbs = handle.total_bytes / wall / 1e9
            print(f"pull {i} [{handle.path}]: {handle.raw_descriptors} naive descriptors -> "
                  f"{handle.num_descriptors} rows; build {handle.build_s * 1e3:.1f} ms, begin_pull {posted * 1e3:.1f} ms, "
                  f"{handle.total_bytes / 2**20:.0f} MiB in {wall * 1e3:.1f} ms = {gbs:.2f} GB/s")
        check = rng.choice(args.blocks, min(8, args.blocks), replace=False)
        ok = torch.equal(dst[:, :, dst_ids[check]].view(torch.uint8), expected[:, :, src_ids[check]].view(torch.uint8))
        print(f"  spot check of {check.size} blocks: {'ok' if ok else 'MISMATCH'}")
    nixl_mod._plan_is_slice_aligned = aligned
    conn.send("stop")
    proc.join(30)
    backend.close()


if __name__ == "__main__":
    main()
