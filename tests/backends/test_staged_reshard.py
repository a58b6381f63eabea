"""The staged reshard plan: whole-slice reads into staging, then one placement per transfer.

A global KV tensor is sharded for both sides; the plan's reads are applied byte for
byte into a staging buffer (what a transport does), the placements copy heads into
the destination pool, and the result must equal the destination's own shard.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvxfer.errors import LayoutError
from kvxfer.plan.reshard import for_dst, plan_kv_reshard
from kvxfer.backends.staged import apply_placement
from kvxfer.plan.staged_reshard import plan_staged_kv, staging_pays
from reshard_support import POOL_BLOCKS, apply_copy_plan, kv_backend, kv_layouts, kv_shard, random_tensor, same_bytes

TOKENS, HEAD_DIM = 3, 5


@pytest.mark.parametrize("src_spec, dst_spec", [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 2), (4, 1)), ((4, 1), (1, 2))])
@pytest.mark.parametrize("max_staging", [1 << 30, 4000])  # one chunk; many chunks
def test_staged_plan_reproduces_the_destination_shard(src_spec, dst_spec, max_staging):
    num_layers, num_heads = 4, 4
    g = random_tensor((2, num_layers, POOL_BLOCKS, TOKENS, num_heads, HEAD_DIM), torch.bfloat16, 5)
    srcs = kv_layouts(*src_spec, num_layers, num_heads)
    dsts = kv_layouts(*dst_spec, num_layers, num_heads, rank_base=50)
    plan = plan_kv_reshard(srcs, dsts)
    rng = np.random.default_rng(3)
    src_ids = np.sort(rng.choice(POOL_BLOCKS, 11, replace=False))  # sorted: runs coalesce
    dst_ids = rng.choice(POOL_BLOCKS, 11, replace=False)
    backends = {x.global_rank: kv_backend(x, kv_shard(g, x), f"s{x.global_rank}") for x in srcs}
    try:
        for d in dsts:
            dst = kv_backend(d, torch.zeros_like(kv_shard(g, d)), f"d{d.global_rank}")
            try:
                for t in for_dst(plan, d.global_rank):
                    src = backends[t.src_rank]
                    assert staging_pays([t], src.geometry, dst.geometry)  # TP differs: 10-byte head fragments
                    for chunk in plan_staged_kv(src.geometry, dst.geometry, [t], src_ids, dst_ids, max_staging):
                        staging = torch.zeros(chunk.staging_bytes, dtype=torch.uint8)
                        apply_copy_plan(chunk.read, src.memory_buffer, staging)
                        for placement in chunk.placements:
                            apply_placement(staging, dst.memory_buffer, placement)
                expected = torch.zeros_like(dst.memory_buffer)
                expected[:, :, torch.from_numpy(dst_ids)] = kv_shard(g, d)[:, :, torch.from_numpy(src_ids)]
                assert same_bytes(dst.memory_buffer, expected)
            finally:
                dst.close()
    finally:
        for b in backends.values():
            b.close()


def test_staged_reads_are_few_and_bounded():
    g = random_tensor((2, 4, POOL_BLOCKS, TOKENS, 4, HEAD_DIM), torch.float32, 6)
    srcs, dst_layout = kv_layouts(2, 1, 4, 4), kv_layouts(1, 1, 4, 4, rank_base=9)[0]
    t = for_dst(plan_kv_reshard(srcs, [dst_layout]), 9)[0]
    src = kv_backend(srcs[t.src_rank], kv_shard(g, srcs[t.src_rank]), "s")
    dst = kv_backend(dst_layout, torch.zeros_like(kv_shard(g, dst_layout)), "d")
    try:
        ids = np.arange(8)
        (chunk,) = plan_staged_kv(src.geometry, dst.geometry, [t], ids, ids, 1 << 20)
        assert chunk.read.num_descriptors == 8  # K and V x 4 layers, 8 consecutive blocks each: one read per plane
        assert chunk.read.raw_descriptors == 8 * 8 * TOKENS  # what per-token fragments would have posted
        small = plan_staged_kv(src.geometry, dst.geometry, [t], ids, ids, 2 * chunk.staging_bytes // 8)
        assert len(small) == 4 and all(c.staging_bytes <= chunk.staging_bytes // 4 for c in small)
        with pytest.raises(LayoutError, match="staging"):
            plan_staged_kv(src.geometry, dst.geometry, [t], ids, ids, 16)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("name", ["nixl", "ucx"])
def test_transports_take_the_staged_path_in_chunks_and_return_their_staging(name):
    from kvxfer.backends import construct_kv_transfer_backend_class
    from kvxfer.runtime.multi_pull import begin_pull_from_peers

    cls = construct_kv_transfer_backend_class(name)
    num_layers, num_heads = 4, 4
    g = random_tensor((2, num_layers, POOL_BLOCKS, TOKENS, num_heads, HEAD_DIM), torch.bfloat16, 8)

    def make(layout, pool, agent, **kw):
        return cls(agent, pool, POOL_BLOCKS, tp_size=layout.tp_size, tp_rank=layout.tp_rank,
                   num_kv_heads_global=num_heads, global_rank=layout.global_rank, pp_size=1, pp_rank=0,
                   num_layers_global=num_layers, **kw)

    srcs = [make(x, kv_shard(g, x), f"staged-{name}-s{x.global_rank}") for x in kv_layouts(2, 1, num_layers, num_heads)]
    dl = kv_layouts(1, 1, num_layers, num_heads, rank_base=10)[0]
    dst = make(dl, torch.zeros_like(kv_shard(g, dl)), f"staged-{name}-d", staging_bytes=16 * 1024)  # 4 KiB chunks
    try:
        ids = np.array([3, 4, 5, 9, 0, 30, 31, 2, 17, 18])
        dst_ids = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
        handle = begin_pull_from_peers(dst, [(s.export_meta(), ids) for s in srcs], dst_ids, request_id="r")
        handle.wait(30)
        assert [p.path for p in handle.parts] == ["staged", "staged"]
        expected = torch.zeros_like(dst.memory_buffer)
        expected[:, :, torch.from_numpy(dst_ids)] = kv_shard(g, dl)[:, :, torch.from_numpy(ids)]
        assert same_bytes(dst.memory_buffer, expected)
        stats = dst.stats()
        assert stats["staging_capacity"] == 16 * 1024 and stats["staging_in_use"] == 0
        assert stats["staging_quarantined"] == 0 and stats["descriptors_posted"] < 10 * 8 * TOKENS
        for s in srcs:  # one read-done per source, after its last chunk
            deadline = time.monotonic() + 10
            done = []
            while not done and time.monotonic() < deadline:
                done = s.drain_read_done()
            assert done == ["r"]
    finally:
        for b in (*srcs, dst):
            b.close()
