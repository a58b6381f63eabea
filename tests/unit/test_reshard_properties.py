"""Property tests of the pure planners over random TP/PP/window combinations.

For any pair of valid layouts: every destination (layer, head) is read exactly once,
nothing outside a destination's slice is read, every local slice lies inside both
pools, and only the lowest-global-rank replica of a source slice is read.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.plan.reshard import for_dst, plan_kv_reshard
from kvxfer.plan.ssm_layout import SSMStateDims
from kvxfer.plan.ssm_reshard import plan_ssm_reshard
from reshard_support import kv_layouts, ssm_layouts


@st.composite
def side(draw, num_layers: int, tp_choices, rank_base: int):
    tp = draw(st.sampled_from(tp_choices))
    pp = draw(st.integers(1, min(4, num_layers)))
    if num_layers % pp == 0 and draw(st.booleans()):
        windows = None
    else:
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1))) if pp > 1 else []
        bounds = [0, *cuts, num_layers]
        windows = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(pp)]
    return tp, pp, windows, rank_base


def _check_cover(plan, srcs, dsts, num_layers, num_heads):
    by_rank = {x.global_rank: x for x in srcs}
    for d in dsts:
        cover = np.zeros((num_layers, num_heads), int)
        (l0, l1), (h0, h1) = d.local_layer_range(), d.local_head_range()
        for t in for_dst(plan, d.global_rank):
            cover[t.layer_start:t.layer_end, t.head_start:t.head_end] += 1
            src = by_rank[t.src_rank]
            (sl0, sl1), (sh0, sh1) = src.local_layer_range(), src.local_head_range()
            assert 0 <= t.src_layer_offset and t.src_layer_offset + t.num_layers <= sl1 - sl0
            assert 0 <= t.dst_layer_offset and t.dst_layer_offset + t.num_layers <= l1 - l0
            assert 0 <= t.src_head_offset and t.src_head_offset + t.num_heads <= sh1 - sh0
            assert 0 <= t.dst_head_offset and t.dst_head_offset + t.num_heads <= h1 - h0
            replicas = [x.global_rank for x in srcs
                        if (x.local_layer_range(), x.local_head_range()) == ((sl0, sl1), (sh0, sh1))]
            assert t.src_rank == min(replicas)
        assert (cover[l0:l1, h0:h1] == 1).all() and cover.sum() == (l1 - l0) * (h1 - h0)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 8), st.sampled_from([1, 2, 4, 8]))
def test_kv_plan_covers_each_destination_exactly_once(data, num_layers, num_heads):
    tps = [1, 2, 4, 8, 16]
    s_tp, s_pp, s_win, _ = data.draw(side(num_layers, tps, 0))
    d_tp, d_pp, d_win, _ = data.draw(side(num_layers, tps, 1000))
    srcs = kv_layouts(s_tp, s_pp, num_layers, num_heads, windows=s_win)
    if data.draw(st.booleans()):  # a data-parallel replica of the whole prefill instance
        srcs = kv_layouts(s_tp, s_pp, num_layers, num_heads, windows=s_win, rank_base=500) + srcs
    dsts = kv_layouts(d_tp, d_pp, num_layers, num_heads, windows=d_win, rank_base=1000)
    _check_cover(plan_kv_reshard(srcs, dsts), srcs, dsts, num_layers, num_heads)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 6))
def test_ssm_plan_covers_each_destination_exactly_once(data, num_layers):
    dims = SSMStateDims(nheads=8, headdim=2, d_state=3, ngroups=4, d_conv=4)
    s_tp, s_pp, s_win, _ = data.draw(side(num_layers, [1, 2, 4], 0))
    d_tp, d_pp, d_win, _ = data.draw(side(num_layers, [1, 2, 4], 1000))
    srcs = ssm_layouts(s_tp, s_pp, num_layers, dims, windows=s_win)
    dsts = ssm_layouts(d_tp, d_pp, num_layers, dims, windows=d_win, rank_base=1000)
    plan = plan_ssm_reshard(srcs, dsts)
    _check_cover(plan, srcs, dsts, num_layers, dims.nheads)
    for t in plan:  # groups follow heads by the same TP fraction
        assert t.num_groups * dims.nheads == t.num_heads * dims.ngroups


@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(1, 6), st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1))
def test_kv_byte_plans_reproduce_the_destination_shards(data, num_layers, num_heads, seed):
    """The flat CopyPlan, applied by a byte copier, equals each destination's direct shard."""
    import torch

    from kvxfer.plan.geometry import compute_buffer_geometry
    from kvxfer.plan.reshard_descriptors import plan_kv_reshard_copies
    from reshard_support import POOL_BLOCKS, apply_copy_plan, kv_shard, random_tensor, same_bytes

    s_tp, s_pp, s_win, _ = data.draw(side(num_layers, [1, 2, 4, 8], 0))
    d_tp, d_pp, d_win, _ = data.draw(side(num_layers, [1, 2, 4, 8], 1000))
    srcs = kv_layouts(s_tp, s_pp, num_layers, num_heads, windows=s_win)
    dsts = kv_layouts(d_tp, d_pp, num_layers, num_heads, windows=d_win, rank_base=1000)
    g = random_tensor((2, num_layers, POOL_BLOCKS, 2, num_heads, 3), torch.float32, seed)
    rng = np.random.default_rng(seed)
    moved = int(rng.integers(1, POOL_BLOCKS))
    src_ids, dst_ids = rng.choice(POOL_BLOCKS, moved, replace=False), rng.choice(POOL_BLOCKS, moved, replace=False)

    def geometry(layout, pool):
        first, last = layout.local_layer_range()
        return compute_buffer_geometry(
            pool, POOL_BLOCKS, backend_name="t", tp_size=layout.tp_size, tp_rank=layout.tp_rank,
            num_kv_heads_global=num_heads, global_rank=layout.global_rank, pp_size=layout.pp_size,
            pp_rank=layout.pp_rank, num_layers_global=num_layers, layer_start=layout.layer_start,
            layer_end=None if layout.layer_start is None else last)

    pools = {x.global_rank: kv_shard(g, x) for x in srcs}
    geoms = {x.global_rank: geometry(x, pools[x.global_rank]) for x in srcs}
    plan = plan_kv_reshard(srcs, dsts)
    for d in dsts:
        pool = torch.zeros_like(kv_shard(g, d))
        dst_geom = geometry(d, pool)
        for t in for_dst(plan, d.global_rank):
            copies = plan_kv_reshard_copies(geoms[t.src_rank], dst_geom, [t], src_ids, dst_ids)
            apply_copy_plan(copies, pools[t.src_rank], pool)
        expected = torch.zeros_like(pool)
        expected[:, :, torch.from_numpy(dst_ids)] = kv_shard(g, d)[:, :, torch.from_numpy(src_ids)]
        assert same_bytes(pool, expected)
