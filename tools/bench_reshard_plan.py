"""Measure reshard descriptor counts and build times (printed, never asserted).

Cases (KV pool ``[2, L, B, T, H, d]``, bf16, d=128, 8 KV heads, a 1024-block pool):

* TP 4 -> 2, 32 layers, 16 tokens per block, 128 blocks per request, scattered
  and contiguous block ids: one decode rank reads two prefill ranks, each a head
  sub-range of its pool, so every token is a fragment (128 x 64 planes x 16 =
  131072 per prefill rank in the flat form; the strided form needs one row per
  plane and block run).
* TP 2 -> 2 (same layout) for comparison: whole slices, coalesced runs.

Usage: ``PYTHONPATH=. python tools/bench_reshard_plan.py [--repeats N]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvxfer.plan.geometry import BufferGeometry, kv_layout_geometry
from kvxfer.plan.layout import KVShardLayout
from kvxfer.plan.reshard import for_dst, plan_kv_reshard
from kvxfer.plan.reshard_descriptors import plan_kv_reshard_copies, plan_kv_reshard_strided

POOL_BLOCKS, HEADS, HEAD_DIM, ELEM = 1024, 8, 128, 2


def geometry(layout: KVShardLayout, tokens: int) -> BufferGeometry:
    """A geometry without a buffer: planning needs numbers only."""
    return kv_layout_geometry(layout, num_blocks=POOL_BLOCKS, tokens_per_block=tokens, head_dim=HEAD_DIM,
                              element_size=ELEM)


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """(median ms, best ms, last result): the best is the figure least disturbed by other load."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3, out


def case(name: str, tp_src: int, tp_dst: int, layers: int, tokens: int, blocks: int, scattered: bool, repeats: int) -> None:
    rng = np.random.default_rng(0)
    srcs = [KVShardLayout(layers, HEADS, tp_size=tp_src, tp_rank=r, global_rank=r) for r in range(tp_src)]
    dsts = [KVShardLayout(layers, HEADS, tp_size=tp_dst, tp_rank=r, global_rank=100 + r) for r in range(tp_dst)]
    if scattered:
        src_ids = rng.choice(POOL_BLOCKS, blocks, replace=False)
        dst_ids = rng.choice(POOL_BLOCKS, blocks, replace=False)
    else:
        src_ids = np.arange(blocks) + 7
        dst_ids = np.arange(blocks) + 300
    plan_ms, _, plan = timed(lambda: plan_kv_reshard(srcs, dsts), repeats)
    dst = dsts[0]
    mine = for_dst(plan, dst.global_rank)
    by_src = {s.global_rank: s for s in srcs}
    flat_rows = strided_rows = raw = 0
    flat_ms = flat_best = strided_ms = 0.0
    for t in mine:
        sg, dg = geometry(by_src[t.src_rank], tokens), geometry(dst, tokens)
        ms, best, p = timed(lambda: plan_kv_reshard_copies(sg, dg, [t], src_ids, dst_ids), repeats)
        flat_ms, flat_best = flat_ms + ms, flat_best + best
        flat_rows, raw = flat_rows + p.num_descriptors, raw + p.raw_descriptors
        ms, _, sp = timed(lambda: plan_kv_reshard_strided(sg, dg, [t], src_ids, dst_ids), repeats)
        strided_ms, strided_rows = strided_ms + ms, strided_rows + sp.num_descriptors
    ids = "scattered" if scattered else "contiguous"
    print(f"{name:<10} TP {tp_src}->{tp_dst}, {layers} layers, {tokens} tok/blk, {blocks} blocks ({ids}); "
          f"decode rank 0 reads {len(mine)} prefill ranks")
    print(f"    layout plan (all ranks): {plan_ms:7.3f} ms, {len(plan)} transfers")
    print(f"    flat CopyPlan:           {flat_ms:7.3f} ms (best {flat_best:.3f}), {flat_rows:>7} rows "
          f"(reference per-token count: {raw})")
    print(f"    strided rows:            {strided_ms:7.3f} ms, {strided_rows:>7} rows")
    print(f"    per prefill rank:        {flat_ms / max(1, len(mine)):7.3f} ms flat (best {flat_best / max(1, len(mine)):.3f}), "
          f"{flat_rows // max(1, len(mine))} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for scattered in (True, False):
        case("reshard", 4, 2, 32, 16, 128, scattered, args.repeats)
    case("same-TP", 2, 2, 32, 16, 128, True, args.repeats)


if __name__ == "__main__":
    main()
