"""Sweep one kvxfer backend over the bench points, two processes where it can.

For each slice size both sides register one pool; each point then runs
``warmup`` unmeasured pulls and ``repeats`` measured ones. The first measured pull
of every point starts from a destination pool reset to a sentinel and is verified
(digest of the pulled blocks equals the source's, and no other block changed), so
a fast wrong transfer shows up as an error, never as a result.

A push backend (``nccl``) is measured in Megatron's push order: the decode posts its
receives (``begin_pull_blocks``, the "post" figure) and asks the source to push; the
transfer time runs from posting to every byte landed in the decode pool, so it
includes that request to the source (one pipe message) and the source's gather.
The source's read-done is its push completing.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterable, Optional

import torch

from kvxfer.backends import construct_kv_transfer_backend_class
from kvxfer.backends.base import KVTransportBackend, TransferHandle
from kvxfer.bench.ceiling import GatherCeiling
from kvxfer.bench.config import RESHARD_SRC_TP, BenchConfig, Point
from kvxfer.bench.results import PointResult
from kvxfer.bench.source import SourceClient, agent_name, open_source, shard_backend
from kvxfer.harness.loopback import SENTINEL, LoopbackConfig, blocks_digest, make_backend, make_pool, untouched

OnPoint = Callable[[PointResult], None]


#: Poll interval while waiting for a transfer. ``wait()`` backs off up to 2 ms, which
#: would show up as latency; a pure spin would hold the GIL and a core that the
#: transport's own progress thread needs (this machine has two). A ~20 us sleep
#: (about 60-80 us with the kernel's timer slack) releases both and bounds the error.
POLL_S = 20e-6


def spin_wait(handle: TransferHandle, timeout_s: float) -> None:
    """Poll ``handle`` every ``POLL_S`` until done; past the deadline ``wait(0)`` raises the standard timeout."""
    deadline = time.monotonic() + timeout_s
    while not handle.poll():
        if time.monotonic() > deadline:
            handle.wait(0.0)
        time.sleep(POLL_S)


def run_backend(cfg: BenchConfig, backend: str, points: Iterable[Point], on_point: Optional[OnPoint] = None) -> list[PointResult]:
    """Measure ``points`` (grouped by slice size) on ``backend``; errors land in the results."""
    construct_kv_transfer_backend_class(backend)  # unknown names fail here, before any process starts
    results: list[PointResult] = []
    source = open_source(backend, cfg.timeout_s)
    request_ids = itertools.count(1)
    try:
        for (size, reshard), group in itertools.groupby(points, key=lambda p: (p.slice_bytes, p.reshard)):
            group = list(group)
            pool_cfg = cfg.pool_config(backend, size)
            tag = f"{size}{'-tp' if reshard else ''}"
            try:
                metas = source.setup(pool_cfg, agent_name("src", tag), RESHARD_SRC_TP if reshard else 1)
                pool = make_pool(pool_cfg, random_seed=None)
                if reshard:  # decode TP 1 holds every head; it reads both prefill ranks
                    decode = shard_backend(pool_cfg, pool, agent_name("dst", tag), tp_size=1, tp_rank=0,
                                           num_heads_global=pool_cfg.num_heads, global_rank=100)
                else:
                    decode = make_backend(pool_cfg, "decode", pool, agent_name=agent_name("dst", tag))
                ceiling = GatherCeiling(pool_cfg, reshard)
            except Exception as exc:  # a size that cannot be set up fails its points, not the run
                for point in group:
                    failed = _result(backend, point, source)
                    failed.error = f"setup: {type(exc).__name__}: {exc}"
                    results.append(failed)
                    if on_point:
                        on_point(failed)
                continue
            try:
                for point in group:
                    res = measure_point(cfg, point, pool_cfg, source, metas, decode, pool, request_ids)
                    if res.ok:  # the point's own ceiling, right after it, into the same destination pool
                        times, why = ceiling.measure(cfg, point, pool)
                        res.set_gather(times)
                        if why:
                            res.extra["gather_error"] = why
                    results.append(res)
                    if on_point:
                        on_point(res)
            finally:
                decode.close()
    finally:
        source.close()
    return results


def _result(backend: str, point: Point, source: SourceClient) -> PointResult:
    res = PointResult(backend, "backend", point.slice_bytes, point.num_blocks, point.pattern, point.reshard)
    res.extra["two_process"] = source.two_process
    return res


def _post(decode: KVTransportBackend, metas: list[dict], src_ids: object, dst_ids: object, request_id: int) -> TransferHandle:
    """One source: ``begin_pull_blocks``. Several (TP ranks): ``begin_pull_from_peers``, one group handle."""
    if len(metas) == 1:
        return decode.begin_pull_blocks(metas[0], src_ids, dst_ids, request_id=request_id)
    from kvxfer.runtime.multi_pull import begin_pull_from_peers

    return begin_pull_from_peers(decode, [(meta, src_ids) for meta in metas], dst_ids, request_id=request_id)


def measure_point(cfg: BenchConfig, point: Point, pool_cfg: LoopbackConfig, source: SourceClient, metas: list[dict],
                  decode: KVTransportBackend, pool: torch.Tensor, request_ids: Iterable[int]) -> PointResult:
    """Warm-up pulls, then measured pulls; the first measured one is verified byte for byte."""
    res = _result(decode.name, point, source)
    peers = [decode.parse_peer_meta(meta) for meta in metas]
    push = decode.is_push
    if push:
        res.extra["direction"] = "push"
        decode_meta = decode.export_meta()  # Megatron's decode sends it with every request
    ids = iter(request_ids)
    try:
        for repeat in range(cfg.warmup + cfg.repeats):
            measured, verify = repeat >= cfg.warmup, repeat == cfg.warmup
            src_ids, dst_ids = cfg.request_config(pool_cfg, point, repeat).block_ids()
            digest = None
            if verify:
                pool.view(torch.uint8).view(-1).fill_(SENTINEL)
                digest = source.digest(src_ids)
            request_id = next(ids)
            t0 = time.perf_counter()
            plans = [decode.plan_pull(peer, src_ids, dst_ids) for peer in peers]  # what begin_pull does inside
            t1 = time.perf_counter()
            if not push:
                source.expect(request_id, cfg.timeout_s)
            t2 = time.perf_counter()
            handle = _post(decode, metas, src_ids, dst_ids, request_id)
            t3 = time.perf_counter()
            if push:  # receives posted: now the prefill pushes
                source.push(request_id, src_ids, decode_meta, cfg.timeout_s)
            spin_wait(handle, cfg.timeout_s)
            t4 = time.perf_counter()
            landed_at = time.monotonic()
            seen_at = source.read_done_at(request_id, cfg.timeout_s)
            res.bytes = sum(p.total_bytes for p in plans)
            res.raw_descriptors = sum(p.raw_descriptors for p in plans)
            res.descriptors = sum(p.num_descriptors for p in plans)
            if verify:
                same = blocks_digest(pool, pool_cfg.pool_blocks, dst_ids) == digest
                res.verified = same and untouched(pool, pool_cfg.pool_blocks, dst_ids)
                if not res.verified:
                    raise RuntimeError("verification failed: " + ("other destination blocks changed" if same else
                                                                  "pulled bytes differ from the source"))
            if measured:
                res.samples.add(build_ms=(t1 - t0) * 1e3, post_ms=(t3 - t2) * 1e3, transfer_ms=(t4 - t2) * 1e3,
                                read_done_ms=(seen_at - landed_at) * 1e3)
    except Exception as exc:  # recorded on the point; the sweep goes on
        res.error = f"{type(exc).__name__}: {exc}"
    return res.summarize()


def run_backends(cfg: BenchConfig, points: list[Point], on_point: Optional[OnPoint] = None) -> list[PointResult]:
    out: list[PointResult] = []
    for backend in cfg.backends:
        out += run_backend(cfg, backend, points, on_point)
    return out


__all__ = ["run_backend", "run_backends", "measure_point", "spin_wait"]
