"""SSM (Mamba-style) conv and recurrent state reshard between different TP/PP.

Same method as ``test_reshard.py``: shard one random global state per kind, pull
into each decode rank with the ``local`` oracle, with the flat byte ``CopyPlan``
and with the strided rows, and compare byte for byte with the decode rank's own
shard. The conv state is the interesting one: its x, B and C bands are each
split by TP, so TP 1->2 splits three bands and TP 2->1 merges them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvxfer.backends.local.backend import LocalBackend
from kvxfer.errors import GeometryError, LayoutError, PeerMetadataError
from kvxfer.meta.geometry import parse_geometry_meta
from kvxfer.runtime.multi_pull import begin_pull_from_peers
from kvxfer.plan.reshard import for_dst
from kvxfer.plan.reshard_descriptors import plan_ssm_reshard_copies, plan_ssm_reshard_strided
from kvxfer.plan.ssm_layout import SSMShardLayout, SSMStateDims
from kvxfer.plan.ssm_reshard import plan_ssm_reshard
from reshard_support import (
    POOL_BLOCKS, apply_copy_plan, apply_strided_rows, conv_shard, random_tensor, recurrent_shard, same_bytes,
    ssm_layouts,
)

DIMS = SSMStateDims(nheads=8, headdim=3, d_state=5, ngroups=4, d_conv=4)
LAYERS, MOVED = 4, 9

CASES = {
    "tp1->2": ((1, 1, None), [(2, 1, None)]),
    "tp2->1": ((2, 1, None), [(1, 1, None)]),
    "tp4->2": ((4, 1, None), [(2, 1, None)]),
    "tp2->4": ((2, 1, None), [(4, 1, None)]),
    "tp1->4": ((1, 1, None), [(4, 1, None)]),
    "tp2pp2->tp4pp1": ((2, 2, None), [(4, 1, None)]),
    "tp1pp1->tp2pp4": ((1, 1, None), [(2, 4, None)]),
    "uneven-pp-many-decode": ((2, 2, [(0, 1), (1, 3)]), [(1, 2, [(0, 3), (3, 1)]), (4, 1, None)]),
}


def _global(kind: str, dtype, seed: int) -> torch.Tensor:
    if kind == "conv":
        return random_tensor((LAYERS, POOL_BLOCKS, DIMS.conv_channels, DIMS.d_conv), dtype, seed)
    return random_tensor((LAYERS, POOL_BLOCKS, DIMS.nheads, DIMS.headdim, DIMS.d_state), dtype, seed)


def _shard(kind, g, layout):
    return conv_shard(g, layout) if kind == "conv" else recurrent_shard(g, layout)


def _backend(layout, pool, kind, name):
    return LocalBackend(name, pool, POOL_BLOCKS, ssm_layout=layout, ssm_state_kind=kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["conv", "recurrent"])
@pytest.mark.parametrize("case", list(CASES))
def test_ssm_reshard_matches_direct_shard(case, kind, dtype):
    src_spec, dst_specs = CASES[case]
    seed = hash((case, kind, str(dtype))) % 2**31
    rng = np.random.default_rng(seed)
    g = _global(kind, dtype, seed)
    src_ids = rng.choice(POOL_BLOCKS, MOVED, replace=False)
    dst_ids = rng.choice(POOL_BLOCKS, MOVED, replace=False)
    tp, pp, windows = src_spec
    src_layouts = ssm_layouts(tp, pp, LAYERS, DIMS, windows=windows)
    sources = {x.global_rank: _backend(x, _shard(kind, g, x), kind, f"p{x.global_rank}") for x in src_layouts}
    metas = [json.loads(json.dumps(b.export_meta())) for b in sources.values()]
    opened = list(sources.values())
    try:
        for n, (tp, pp, windows) in enumerate(dst_specs):
            dst_layouts = ssm_layouts(tp, pp, LAYERS, DIMS, windows=windows, rank_base=100 * (n + 1))
            plan = plan_ssm_reshard(src_layouts, dst_layouts)
            for dl in dst_layouts:
                garbage = random_tensor(_shard(kind, g, dl).shape, dtype, seed + dl.global_rank + 1)
                expected = garbage.clone()
                expected[:, torch.from_numpy(dst_ids)] = _shard(kind, g, dl)[:, torch.from_numpy(src_ids)]
                pools = [garbage.clone() for _ in range(4)]
                dsts = [_backend(dl, p, kind, f"d{dl.global_rank}-{i}") for i, p in enumerate(pools)]
                opened += dsts

                begin_pull_from_peers(dsts[0], [(m, src_ids) for m in metas], dst_ids).wait(5)
                assert same_bytes(pools[0], expected), "local oracle"
                for t in for_dst(plan, dl.global_rank):
                    src = sources[t.src_rank]
                    args = (src.geometry, src.ssm_layout, dsts[1].geometry, dl, kind, [t], src_ids, dst_ids)
                    copies = plan_ssm_reshard_copies(*args)
                    apply_copy_plan(copies, src.memory_buffer, pools[1])
                    strided = plan_ssm_reshard_strided(*args)
                    assert strided.total_bytes == copies.total_bytes
                    apply_strided_rows(strided, src.memory_buffer, pools[2])
                assert same_bytes(pools[1], expected), "flat byte CopyPlan"
                assert same_bytes(pools[2], expected), "strided rows"
                for meta, src in zip(metas, sources.values()):
                    hook = dsts[3].plan_pull(dsts[3].parse_peer_meta(meta), src_ids, dst_ids)
                    apply_copy_plan(hook, src.memory_buffer, pools[3])
                assert same_bytes(pools[3], expected), "KVTransportBackend.plan_pull"
    finally:
        for b in opened:
            b.close()


def test_conv_bands_are_split_not_cut_contiguously():
    """TP 1 -> 2 conv: rank 1 reads three separate channel runs, one per band."""
    src, dst = ssm_layouts(1, 1, LAYERS, DIMS), ssm_layouts(2, 1, LAYERS, DIMS, rank_base=10)
    t = for_dst(plan_ssm_reshard(src, dst), 11)[0]
    ranges = [(c.band, c.src_channel, c.dst_channel, c.num_channels) for c in t.conv_channel_ranges(src[0], dst[1])]
    x, gs = DIMS.nheads * DIMS.headdim, DIMS.ngroups * DIMS.d_state
    assert ranges == [("x", x // 2, 0, x // 2), ("B", x + gs // 2, x // 2, gs // 2),
                      ("C", x + gs + gs // 2, x // 2 + gs // 2, gs // 2)]


def test_ssm_layout_round_trips_and_is_validated_on_parse():
    layout = SSMShardLayout(global_rank=3, tp_size=2, tp_rank=1, layer_start=LAYERS // 2, num_layers=LAYERS // 2, dims=DIMS)
    assert SSMShardLayout.from_meta(json.loads(json.dumps(layout.to_meta()))) == layout
    pool = torch.zeros(layout.state_shape("conv", POOL_BLOCKS))
    b = _backend(layout, pool, "conv", "x")
    try:
        meta = json.loads(json.dumps(b.export_meta()))
        assert parse_geometry_meta(meta).ssm_layout == layout
        meta["ssm_layout"]["dims"]["ngroups"] = 3
        with pytest.raises(PeerMetadataError, match="ssm_layout"):
            parse_geometry_meta(meta)
        meta["ssm_layout"] = {"num_layers": 4}  # no dims
        with pytest.raises(PeerMetadataError, match="dims"):
            parse_geometry_meta(meta)
    finally:
        b.close()


def test_ssm_invalid_combinations():
    with pytest.raises(LayoutError, match="SSM groups"):
        SSMShardLayout(0, 8, 0, 0, LAYERS, DIMS)  # 4 groups over 8 ranks
    with pytest.raises(LayoutError, match="SSM heads"):
        SSMShardLayout(0, 4, 0, 0, LAYERS, SSMStateDims(6, 3, 5, 2, 4))
    other = SSMStateDims(nheads=8, headdim=3, d_state=7, ngroups=4, d_conv=4)
    with pytest.raises(LayoutError, match="different models"):
        plan_ssm_reshard(ssm_layouts(2, 1, LAYERS, DIMS), ssm_layouts(2, 1, LAYERS, other, rank_base=5))
    with pytest.raises(LayoutError, match="overlaps"):
        plan_ssm_reshard(ssm_layouts(1, 2, LAYERS, DIMS, windows=[(0, 3), (2, 2)]), ssm_layouts(1, 1, LAYERS, DIMS, rank_base=5))


def test_ssm_pool_shape_must_match_layout():
    layout = SSMShardLayout(0, 2, 0, 0, LAYERS, DIMS)
    with pytest.raises(GeometryError, match="ssm_layout gives"):
        _backend(layout, torch.zeros(LAYERS, POOL_BLOCKS, DIMS.conv_channels, DIMS.d_conv), "conv", "x")


def test_ssm_kind_mismatch_refused_before_moving():
    layout = SSMShardLayout(0, 1, 0, 0, LAYERS, DIMS)
    conv = _backend(layout, torch.ones(layout.state_shape("conv", POOL_BLOCKS)), "conv", "c")
    rec = _backend(layout, torch.zeros(layout.state_shape("recurrent", POOL_BLOCKS)), "recurrent", "r")
    try:
        with pytest.raises(PeerMetadataError, match="conv"):
            rec.begin_pull_blocks(conv.export_meta(), [1], [1])
        assert not rec.memory_buffer.any()
    finally:
        conv.close()
        rec.close()
