"""KV reshard between prefill and decode of different TP/PP.

Each case shards one random global KV tensor ``[2, L, B, T, H, d]`` by the source
layout (one ``local`` backend per prefill rank, all in this process), then fills
every decode rank three ways and compares each, byte for byte, with the decode
rank's own shard of the global tensor:

* the ``local`` oracle (tensor views) through ``begin_pull_from_peers``;
* the flat ``CopyPlan`` from ``plan_kv_reshard`` + ``plan_kv_reshard_copies``,
  applied by a tiny numpy byte copier (what NIXL/UCX post);
* the strided rows, applied fragment by fragment;
* the plans ``KVTransportBackend.plan_pull`` builds from peer meta (the base hook).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvxfer.meta.seal import seal_meta
import torch

from kvxfer.backends.base import CompletedHandle
from kvxfer.errors import LayoutError, PeerMetadataError
from kvxfer.meta.geometry import parse_geometry_meta
from kvxfer.plan.layout import KVShardLayout
from kvxfer.runtime.multi_pull import begin_pull_from_peers
from kvxfer.plan.reshard import for_dst, for_src, plan_kv_reshard
from kvxfer.plan.reshard_descriptors import plan_kv_reshard_copies, plan_kv_reshard_strided
from reshard_support import (
    POOL_BLOCKS, apply_copy_plan, apply_strided_rows, kv_backend, kv_layouts, kv_shard, random_tensor, same_bytes,
)

TOKENS, HEAD_DIM, MOVED = 3, 5, 11

# name -> (num_layers, num_heads, source (tp, pp, windows), [destination (tp, pp, windows), ...])
CASES = {
    "tp1->2": (4, 4, (1, 1, None), [(2, 1, None)]),
    "tp2->1": (4, 4, (2, 1, None), [(1, 1, None)]),
    "tp2->4": (4, 4, (2, 1, None), [(4, 1, None)]),
    "tp4->2": (4, 4, (4, 1, None), [(2, 1, None)]),
    "tp8->2-replicated": (4, 2, (8, 1, None), [(2, 1, None)]),
    "tp2->8-replicated": (4, 2, (2, 1, None), [(8, 1, None)]),
    "tp4->8-replicated": (4, 2, (4, 1, None), [(8, 1, None)]),
    "pp1->2": (6, 4, (1, 1, None), [(1, 2, None)]),
    "pp2->3": (6, 4, (1, 2, None), [(1, 3, None)]),
    "tp2pp2->tp4pp3": (6, 4, (2, 2, None), [(4, 3, None)]),
    "uneven-pp": (6, 4, (2, 2, [(0, 1), (1, 5)]), [(1, 3, [(0, 3), (3, 1), (4, 2)])]),
    "one-prefill-many-decode": (6, 4, (2, 2, None), [(1, 1, None), (4, 3, None), (1, 2, [(0, 5), (5, 1)]), (8, 1, None)]),
}


def _layouts(num_layers, num_heads, spec, rank_base):
    tp, pp, windows = spec
    return kv_layouts(tp, pp, num_layers, num_heads, windows=windows, rank_base=rank_base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kv_reshard_matches_direct_shard(case, dtype):
    num_layers, num_heads, src_spec, dst_specs = CASES[case]
    seed = hash((case, str(dtype))) % 2**31
    rng = np.random.default_rng(seed)
    g = random_tensor((2, num_layers, POOL_BLOCKS, TOKENS, num_heads, HEAD_DIM), dtype, seed)
    src_ids = rng.choice(POOL_BLOCKS, MOVED, replace=False)
    dst_ids = rng.choice(POOL_BLOCKS, MOVED, replace=False)
    src_layouts = _layouts(num_layers, num_heads, src_spec, 0)
    sources = {x.global_rank: kv_backend(x, kv_shard(g, x), f"prefill-{x.global_rank}") for x in src_layouts}
    metas = [json.loads(json.dumps(b.export_meta())) for b in sources.values()]  # through the wire form
    opened = list(sources.values())
    try:
        for n, spec in enumerate(dst_specs):
            dst_layouts = _layouts(num_layers, num_heads, spec, 100 * (n + 1))
            plan = plan_kv_reshard(src_layouts, dst_layouts)
            assert plan == plan_kv_reshard(list(reversed(src_layouts)), dst_layouts)  # order-independent
            for dl in dst_layouts:
                garbage = random_tensor(kv_shard(g, dl).shape, dtype, seed + dl.global_rank + 1)
                expected = garbage.clone()
                expected[:, :, torch.from_numpy(dst_ids)] = kv_shard(g, dl)[:, :, torch.from_numpy(src_ids)]
                pools = [garbage.clone() for _ in range(4)]
                dsts = [kv_backend(dl, pool, f"decode-{dl.global_rank}-{i}") for i, pool in enumerate(pools)]
                opened += dsts

                begin_pull_from_peers(dsts[0], [(m, src_ids) for m in metas], dst_ids, request_id=7).wait(5)
                assert same_bytes(pools[0], expected), "local oracle"

                for t in for_dst(plan, dl.global_rank):
                    src = sources[t.src_rank]
                    copies = plan_kv_reshard_copies(src.geometry, dsts[1].geometry, [t], src_ids, dst_ids)
                    apply_copy_plan(copies, src.memory_buffer, pools[1])
                    strided = plan_kv_reshard_strided(src.geometry, dsts[2].geometry, [t], src_ids, dst_ids)
                    assert strided.total_bytes == copies.total_bytes
                    assert strided.num_descriptors <= copies.num_descriptors
                    apply_strided_rows(strided, src.memory_buffer, pools[2])
                assert same_bytes(pools[1], expected), "flat byte CopyPlan"
                assert same_bytes(pools[2], expected), "strided rows"

                for meta, src in zip(metas, sources.values()):  # the base.plan_pull hook, every peer
                    hook = dsts[3].plan_pull(dsts[3].parse_peer_meta(meta), src_ids, dst_ids)
                    apply_copy_plan(hook, src.memory_buffer, pools[3])
                assert same_bytes(pools[3], expected), "KVTransportBackend.plan_pull"
    finally:
        for b in opened:
            b.close()


def test_replicas_are_read_once_and_others_complete_at_once():
    """TP 8 -> 2 with 2 KV heads: each head lives on 4 prefill ranks; read the lowest one only."""
    g = random_tensor((2, 2, POOL_BLOCKS, TOKENS, 2, HEAD_DIM), torch.float32, 1)
    srcs = kv_layouts(8, 1, 2, 2)
    backends = [kv_backend(x, kv_shard(g, x), f"p{x.global_rank}") for x in srcs]
    dst_layout = kv_layouts(2, 1, 2, 2, rank_base=50)[1]  # holds head 1: prefill ranks 4..7
    dst = kv_backend(dst_layout, torch.zeros_like(kv_shard(g, dst_layout)), "d")
    try:
        ids = [5, 2, 30]
        handle = begin_pull_from_peers(dst, [(b.export_meta(), ids) for b in backends], ids, request_id="r1")
        handle.wait(5)
        assert [type(p) is CompletedHandle for p in handle.parts] == [True] * 4 + [False] + [True] * 3
        assert [b.drain_read_done() for b in backends] == [[]] * 4 + [["r1"]] + [[]] * 3
        assert same_bytes(dst.memory_buffer[:, :, ids], kv_shard(g, dst_layout)[:, :, ids])
        # a single pull from a peer holding none of our heads completes at once and moves nothing
        before = dst.memory_buffer.clone()
        assert isinstance(dst.begin_pull_blocks(backends[0].export_meta(), [1], [1]), CompletedHandle)
        assert same_bytes(dst.memory_buffer, before)
    finally:
        for b in (*backends, dst):
            b.close()


def test_data_parallel_replicas_pick_lowest_global_rank():
    srcs = kv_layouts(2, 1, 4, 4) + kv_layouts(2, 1, 4, 4, rank_base=10)  # two identical DP replicas
    random.Random(0).shuffle(srcs)
    plan = plan_kv_reshard(srcs, kv_layouts(1, 1, 4, 4, rank_base=20))
    assert sorted(t.src_rank for t in plan) == [0, 1]
    assert plan == plan_kv_reshard(kv_layouts(2, 1, 4, 4), kv_layouts(1, 1, 4, 4, rank_base=20))


def test_both_sides_compute_the_same_plan_and_split_it():
    srcs, dsts = kv_layouts(2, 2, 6, 4), kv_layouts(4, 3, 6, 4, rank_base=10)
    plan = plan_kv_reshard(srcs, dsts)
    by_dst = [t for d in dsts for t in for_dst(plan, d.global_rank)]
    by_src = [t for s in srcs for t in for_src(plan, s.global_rank)]
    assert sorted(by_dst, key=repr) == sorted(by_src, key=repr) == sorted(plan, key=repr)
    # every destination (layer, head) is covered exactly once
    for d in dsts:
        cover = np.zeros((6, 4), int)
        for t in for_dst(plan, d.global_rank):
            cover[t.layer_start:t.layer_end, t.head_start:t.head_end] += 1
        (l0, l1), (h0, h1) = d.local_layer_range(), d.local_head_range()
        assert (cover[l0:l1, h0:h1] == 1).all() and cover.sum() == (l1 - l0) * (h1 - h0)


def test_transfer_local_slices():
    plan = plan_kv_reshard(kv_layouts(4, 1, 4, 8), kv_layouts(2, 2, 4, 8, rank_base=10))
    t = next(t for t in plan if t.dst_rank == 13 and t.src_rank == 3)  # dst: pp1 tp1 -> layers 2-3, heads 4-7
    assert (t.layer_start, t.layer_end, t.head_start, t.head_end) == (2, 4, 6, 8)
    assert (t.src_layers, t.dst_layers, t.src_heads, t.dst_heads) == (slice(2, 4), slice(0, 2), slice(0, 2), slice(2, 4))


def test_layout_round_trips_through_wire_schema():
    g = torch.zeros(2, 3, POOL_BLOCKS, TOKENS, 2, HEAD_DIM)
    b = kv_backend(KVShardLayout(6, 4, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1, global_rank=3,
                                 layer_start=3, num_local_layers=3), g, "x")
    try:
        meta = json.loads(json.dumps(b.export_meta()))
        assert parse_geometry_meta(meta).geometry.layout == b.geometry.layout
        assert KVShardLayout.from_meta(b.geometry.layout.to_meta()) == b.geometry.layout
        assert b.geometry.layout.local_layer_range() == (3, 6) and b.geometry.layout.local_head_range() == (2, 4)
    finally:
        b.close()


# --- invalid combinations: clear errors before anything moves ---------------------------------
def test_heads_not_divisible():
    with pytest.raises(LayoutError, match="do not divide evenly"):
        KVShardLayout(4, 6, tp_size=4)
    with pytest.raises(LayoutError, match="not a multiple"):
        KVShardLayout(4, 4, tp_size=6)


def test_different_models_refused():
    with pytest.raises(LayoutError, match="different models"):
        plan_kv_reshard(kv_layouts(2, 1, 4, 4), kv_layouts(2, 1, 8, 4))
    with pytest.raises(LayoutError, match="different models"):
        plan_kv_reshard(kv_layouts(2, 1, 4, 4), kv_layouts(2, 1, 4, 8))


@pytest.mark.parametrize("windows, message", [
    ([(0, 4), (3, 3)], "overlaps"),
    ([(0, 2), (3, 3)], r"layers \[2, 3\) are held by no pipeline stage"),
    ([(0, 2), (2, 3)], r"layers \[5, 6\) are held by no pipeline stage"),
])
def test_layer_windows_must_tile(windows, message):
    bad = kv_layouts(1, 2, 6, 4, windows=windows)
    with pytest.raises(LayoutError, match=message):
        plan_kv_reshard(bad, kv_layouts(1, 1, 6, 4, rank_base=10))
    with pytest.raises(LayoutError, match="decode"):
        plan_kv_reshard(kv_layouts(1, 1, 6, 4, rank_base=10), bad)


def test_missing_tp_rank_and_mixed_sizes():
    with pytest.raises(LayoutError, match="not each of the 4 heads"):
        plan_kv_reshard(kv_layouts(2, 1, 4, 4)[:1], kv_layouts(1, 1, 4, 4, rank_base=5))
    with pytest.raises(LayoutError, match="disagree"):
        plan_kv_reshard(kv_layouts(2, 1, 4, 4) + kv_layouts(4, 1, 4, 4, rank_base=5), kv_layouts(1, 1, 4, 4, rank_base=20))


def test_backend_pulls_refuse_bad_combinations_before_moving():
    g = random_tensor((2, 4, POOL_BLOCKS, TOKENS, 4, HEAD_DIM), torch.float32, 3)
    srcs = kv_layouts(2, 1, 4, 4)
    backends = [kv_backend(x, kv_shard(g, x), f"p{x.global_rank}") for x in srcs]
    dst_layout = KVShardLayout(4, 4, global_rank=9)
    dst = kv_backend(dst_layout, torch.zeros(2, 4, POOL_BLOCKS, TOKENS, 4, HEAD_DIM), "d")
    other_model = KVShardLayout(8, 4, tp_size=2, global_rank=3, pp_size=2)
    other = kv_backend(other_model, kv_shard(random_tensor((2, 8, POOL_BLOCKS, TOKENS, 4, HEAD_DIM), torch.float32, 4), other_model), "o")
    bf16 = kv_backend(srcs[0], kv_shard(g, srcs[0]).to(torch.bfloat16), "b")
    try:
        ids = [1, 2]
        with pytest.raises(LayoutError, match="rank 9"):  # only half the heads offered
            begin_pull_from_peers(dst, [(backends[0].export_meta(), ids)], ids)
        with pytest.raises(LayoutError, match="different models"):
            begin_pull_from_peers(dst, [(b.export_meta(), ids) for b in (*backends, other)], ids)
        with pytest.raises(LayoutError, match="different models"):
            dst.begin_pull_blocks(other.export_meta(), ids, ids)
        with pytest.raises(PeerMetadataError, match="dtype"):
            dst.begin_pull_blocks(bf16.export_meta(), ids, ids)
        assert not dst.memory_buffer.any()
        assert all(not b.drain_read_done() for b in backends)
    finally:
        for b in (*backends, dst, other, bf16):
            b.close()


def test_inconsistent_peer_meta_refused():
    g = random_tensor((2, 4, POOL_BLOCKS, TOKENS, 4, HEAD_DIM), torch.float32, 5)
    src_layout = KVShardLayout(4, 4, global_rank=0)
    src = kv_backend(src_layout, kv_shard(g, src_layout), "s")
    dst_layout = KVShardLayout(4, 4, tp_size=2, global_rank=1)
    dst = kv_backend(dst_layout, torch.zeros(2, 4, POOL_BLOCKS, TOKENS, 2, HEAD_DIM), "d")
    try:
        meta = src.export_meta()
        meta["tp_size"] = 2  # the layout fields say 2 heads per rank, the pool holds 4
        seal_meta(meta)
        with pytest.raises(PeerMetadataError, match="do not match its KV layout"):
            dst.begin_pull_blocks(meta, [0], [0])
        assert not dst.memory_buffer.any()
    finally:
        src.close()
        dst.close()


def test_strided_hook_matches_flat_hook():
    from kvxfer.plan.reshard_descriptors import plan_reshard_pull, plan_reshard_pull_strided

    g = random_tensor((2, 4, POOL_BLOCKS, TOKENS, 4, HEAD_DIM), torch.float32, 8)
    src_layout, dst_layout = KVShardLayout(4, 4, tp_size=4, tp_rank=1, global_rank=1), KVShardLayout(4, 4, tp_size=2, global_rank=7)
    src = kv_backend(src_layout, kv_shard(g, src_layout), "s")
    dst = kv_backend(dst_layout, torch.zeros(2, 4, POOL_BLOCKS, TOKENS, 2, HEAD_DIM), "d")
    try:
        peer = dst.parse_peer_meta(src.export_meta())
        ids = np.arange(5, 15)  # one run: each K/V layer plane is a single strided row of 10 blocks x 3 tokens
        strided = plan_reshard_pull_strided(dst.local_pool, peer, ids, ids + 3)
        flat = plan_reshard_pull(dst.local_pool, peer, ids, ids + 3)
        assert strided.num_descriptors == 2 * 4 and set(strided.counts.tolist()) == {10 * TOKENS}
        assert flat.num_descriptors == 2 * 4 * 10 * TOKENS == flat.raw_descriptors
        assert strided.to_copy_plan().total_bytes == flat.total_bytes
    finally:
        src.close()
        dst.close()
