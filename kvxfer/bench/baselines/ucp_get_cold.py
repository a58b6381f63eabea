"""``ucp_get`` between two processes over buffers larger than the last-level cache.

Why not ``ucx_perftest`` alone: it reads one buffer of the message size over and over
(UCX 1.22's options -- ``-s``, ``-n``, ``-w``, ``-O``, ``-D iov`` with ``-i`` spacing the
entries of *one* message -- give no way to spread its iterations over a larger region),
so up to the cache size its figure is a cache-to-cache copy, which flatters it at 1 MiB.
This baseline reads the same way UCX's own benchmark does -- ``ucp_get_nbx`` of one
message size, an endpoint without peer error handling (ucx_perftest's default, hence
the same protocol: CMA zero-copy on one host) -- but cycles through a source region and a
destination region each larger than the LLC (``machine.llc_bytes()``; 2x it by default),
so every get reads memory that has left the cache. It is the inter-process ceiling
at a point's coalesced message size.

It uses kvxfer's own UCP binding (``kvxfer.backends.ucx.binding``), not the ucx
backend: no planner, no notification, no Python per get. Each batch posts up to
4 MiB (at most 128 gets) of consecutive messages at once (``kvx_get_batch``, as a kvxfer request posts its
rows) and progresses until all complete; a sample is the batch time divided by its
gets (per-get time, so *p50/p99* are per message). The first measured batch is
verified against the source's contents (a known word pattern). The source process
busy-polls its worker, as ucx_perftest's server does (small gets need it).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Optional, Sequence

import numpy as np

from kvxfer.bench.results import PointResult, Unavailable

NAME = "ucp-get-cold"
AM_ID = 0x4B57
BATCH_BYTES = 4 << 20
MAX_BATCH = 128  # more in flight at once: 4 KiB gets (UCX's short protocol here) stall


def availability() -> Optional[Unavailable]:
    try:
        from kvxfer.backends.ucx import binding

        binding.load()
    except ImportError as exc:
        return Unavailable(NAME, f"the UCX binding is not loadable: {exc}")
    return None


def _source(conn: Any, region_bytes: int) -> None:
    """The source process: a registered region of known words; serves gets until told to stop."""
    from kvxfer.backends.ucx import binding

    binding.load()
    words = np.arange(region_bytes // 8, dtype=np.uint64)  # word i holds i: a get is checkable anywhere
    ctx = binding.Context()
    worker = binding.Worker(ctx, AM_ID)
    region = binding.MemoryRegion(ctx, words.ctypes.data, words.nbytes, cuda=False)
    try:
        conn.send((worker.address, region.packed_rkey, words.ctypes.data, words.nbytes))
        # busy progress, as ucx_perftest's server: gets below the zero-copy threshold (UCX 1.22: < ~4.4 KiB
        # here) are served by the source's worker, and a sleeping one would add a wake-up to each
        while not conn.poll(0):
            for _ in range(200):
                worker.progress()
    except (EOFError, OSError):
        pass
    finally:
        region.close()
        worker.close()
        ctx.close()


def _measure_size(binding: Any, ep: Any, rkey: Any, worker: Any, local: np.ndarray, remote_base: int,
                  region_bytes: int, size: int, warm_bytes: int) -> PointResult:
    res = PointResult(NAME, "baseline", size, 1, "contiguous", bytes=size, raw_descriptors=1, descriptors=1)
    res.extra["two_process"] = True
    slots = region_bytes // size
    per_batch = max(1, min(MAX_BATCH, BATCH_BYTES // size, slots))
    warm = max(1, warm_bytes // (size * per_batch))
    batches = warm + max(16, slots // per_batch)  # at least one full pass over the region, measured
    res.extra.update(region_bytes=region_bytes, gets_per_batch=per_batch, measured_gets=(batches - warm) * per_batch)
    local_base = local.ctypes.data
    lib = binding.load()[1]
    steps = np.arange(per_batch, dtype=np.int64)
    k = 0
    total_s = 0.0
    try:
        for b in range(batches):
            src = ((k + steps) % slots) * size
            dst = ((k + steps + slots // 2) % slots) * size  # another phase: never the same address pair twice
            k += per_batch
            lengths = np.full(per_batch, size, dtype=np.int64)
            t0 = time.perf_counter()
            batch = binding.GetBatch(ep, rkey, local_base, remote_base, src, dst, lengths, cuda=False)
            while not batch.done:
                worker.progress()
            t1 = time.perf_counter()
            batch.release()
            if batch.post_status != lib.UCS_OK or batch.status != lib.UCS_OK:
                raise RuntimeError(f"ucp_get failed: {binding.status_string(batch.status or batch.post_status)}")
            if b == warm:
                got = local.view(np.uint64)[(dst[:, None] // 8) + np.arange(size // 8)[None, :]]
                expected = (src[:, None] // 8 + np.arange(size // 8)[None, :]).astype(np.uint64)
                res.verified = bool(np.array_equal(got, expected))
                if not res.verified:
                    raise RuntimeError("verification failed: the gets did not land the source's words")
            if b >= warm:
                total_s += t1 - t0
                per_get_ms = (t1 - t0) * 1e3 / per_batch
                res.samples.add(build_ms=0.0, post_ms=0.0, transfer_ms=per_get_ms)
        res.summarize()
        res.gbps_mean = res.extra["measured_gets"] * size / total_s / 1e9
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


def run(sizes: Sequence[int], region_bytes: int, timeout_s: float = 60.0, llc_bytes: Optional[int] = None,
        on_point: Any = None) -> list[PointResult]:
    """Every size, one source process and one endpoint for all (a worker-process target: ``on_point`` streams)."""
    from kvxfer.backends.ucx import binding

    binding.load()
    region_bytes -= region_bytes % max(sizes)
    ctx_mp = mp.get_context("spawn")
    parent, child = ctx_mp.Pipe()
    proc = ctx_mp.Process(target=_source, args=(child, region_bytes), daemon=True)
    proc.start()
    results: list[PointResult] = []
    ctx = worker = region = ep = rkey = None
    try:
        if not parent.poll(max(timeout_s, 120.0)):  # a spawned Python importing torch: minutes on a loaded 2-core machine
            raise TimeoutError("the ucp_get source process did not answer")
        address, packed, remote_base, remote_len = parent.recv()
        local = np.zeros(region_bytes // 8, dtype=np.uint64).view(np.uint8)  # zeros: every page faulted in now
        ctx = binding.Context()
        worker = binding.Worker(ctx, AM_ID)
        region = binding.MemoryRegion(ctx, local.ctypes.data, local.nbytes, cuda=False)
        ep = binding.Endpoint(worker, address, lambda endpoint, status: None, peer_error_handling=False)
        rkey = binding.RemoteKey(ep, packed)
        lanes = None
        for size in sorted(set(sizes)):
            res = _measure_size(binding, ep, rkey, worker, local, remote_base, region_bytes, size,
                                warm_bytes=min(region_bytes, 64 << 20))
            lanes = lanes or sorted({f"{t}/{d}" for t, d in ep.transports()})
            res.extra.update(llc_bytes=llc_bytes, transports=lanes)
            results.append(res)
            if on_point:
                on_point(res)
    finally:
        for obj in (rkey, ep):
            if obj is not None:
                obj.close()
        for obj in (region, worker, ctx):
            if obj is not None:
                obj.close()
        try:
            parent.send("stop")
        except (OSError, BrokenPipeError):
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    return results


__all__ = ["NAME", "availability", "run"]
