"""The descriptor-build figure of the TP-reshard axis.

It measures the third target: building the descriptors of one TP 2 -> 1 request of 128 blocks x 64 layer
planes x 16 tokens per block (scattered ids), i.e. the decode rank's plans for both
prefill ranks, each of which holds half the heads, so every token row is a
fragment before coalescing. Pure planning: no pool, no transport.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

TARGET_MS = 10.0
BLOCKS, LAYERS, TOKENS, HEADS, HEAD_DIM, ELEM, POOL_BLOCKS = 128, 32, 16, 8, 128, 2, 1024


def _geometry(layout: Any, pool_blocks: int) -> Any:
    from kvxfer.plan.geometry import kv_layout_geometry

    return kv_layout_geometry(layout, num_blocks=pool_blocks, tokens_per_block=TOKENS, head_dim=HEAD_DIM,
                              element_size=ELEM)


def measure_build(repeats: int = 20, seed: int = 0) -> dict[str, Any]:
    """Median time to plan the request on the decode rank; every figure, or why not measured."""
    out: dict[str, Any] = {"target": f"< {TARGET_MS} ms", "case": f"TP 2 -> 1, {BLOCKS} blocks x {2 * LAYERS} planes x "
                           f"{TOKENS} tokens, {HEADS} heads, head_dim {HEAD_DIM}, bf16, scattered ids"}
    try:
        import numpy as np

        from kvxfer.plan.layout import KVShardLayout
        from kvxfer.plan.reshard import for_dst, plan_kv_reshard
        from kvxfer.plan.reshard_descriptors import plan_kv_reshard_copies, plan_kv_reshard_strided

        rng = np.random.default_rng(seed)
        src_ids = rng.choice(POOL_BLOCKS, BLOCKS, replace=False)
        dst_ids = rng.choice(POOL_BLOCKS, BLOCKS, replace=False)
        srcs = [KVShardLayout(LAYERS, HEADS, tp_size=2, tp_rank=r, global_rank=r) for r in range(2)]
        dst = KVShardLayout(LAYERS, HEADS, tp_size=1, tp_rank=0, global_rank=100)
        by_rank = {s.global_rank: s for s in srcs}
        dst_geo = _geometry(dst, POOL_BLOCKS)

        def build(planner: Any) -> tuple[int, int]:
            rows = raw = 0
            for transfer in for_dst(plan_kv_reshard(srcs, [dst]), dst.global_rank):
                plan = planner(_geometry(by_rank[transfer.src_rank], POOL_BLOCKS), dst_geo, [transfer], src_ids, dst_ids)
                rows, raw = rows + plan.num_descriptors, raw + getattr(plan, "raw_descriptors", 0)
            return rows, raw

        for form, planner in (("flat", plan_kv_reshard_copies), ("strided", plan_kv_reshard_strided)):
            build(planner)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                rows, raw = build(planner)
                times.append((time.perf_counter() - t0) * 1e3)
            median = statistics.median(times)
            out[form] = dict(build_ms_p50=median, build_ms_max=max(times), descriptors=rows, raw_descriptors=raw,
                             repeats=repeats, met=median < TARGET_MS)
        out["met"] = any(out[form]["met"] for form in ("flat", "strided"))
    except Exception as exc:  # a planning failure is a finding of the run: report it, never crash the bench
        out["status"] = f"not measured: {type(exc).__name__}: {exc}"
    return out
