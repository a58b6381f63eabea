"""Shared helpers for the reshard tests: layouts, shards of a global tensor, byte copiers."""

from __future__ import annotations

import numpy as np
import torch

from kvxfer.backends.local.backend import LocalBackend
from kvxfer.plan.descriptors import CopyPlan
from kvxfer.plan.layout import KVShardLayout
from kvxfer.plan.ssm_layout import SSMShardLayout, SSMStateDims

POOL_BLOCKS = 37  # distinct from every other pool dim, so the blocks axis is unambiguous


def kv_layouts(tp: int, pp: int, num_layers: int, num_heads: int, *, windows=None, rank_base: int = 0) -> list[KVShardLayout]:
    """Every rank of one instance; ``windows`` = [(layer_start, num_local_layers)] per stage."""
    out = []
    for p in range(pp):
        start, n = windows[p] if windows else (None, None)
        for t in range(tp):
            out.append(KVShardLayout(num_layers, num_heads, tp_size=tp, tp_rank=t, pp_size=pp, pp_rank=p,
                                     global_rank=rank_base + p * tp + t, layer_start=start, num_local_layers=n))
    return out


def ssm_layouts(tp: int, pp: int, num_layers: int, dims: SSMStateDims, *, windows=None, rank_base: int = 0) -> list[SSMShardLayout]:
    """Every rank of one instance, in Megatron's shape (a stage is its window; even split by default)."""
    windows = windows or [(p * (num_layers // pp), num_layers // pp) for p in range(pp)]
    return [SSMShardLayout(global_rank=rank_base + p * tp + t, tp_size=tp, tp_rank=t, layer_start=start,
                           num_layers=n, dims=dims)
            for p, (start, n) in enumerate(windows) for t in range(tp)]


def random_tensor(shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def kv_shard(global_kv: torch.Tensor, layout: KVShardLayout) -> torch.Tensor:
    """The rank's pool, cut directly from the global ``[2, L, B, T, H, d]`` tensor."""
    l0, l1 = layout.local_layer_range()
    h0, h1 = layout.local_head_range()
    return global_kv[:, l0:l1, :, :, h0:h1].contiguous()


def conv_shard(global_conv: torch.Tensor, layout: SSMShardLayout) -> torch.Tensor:
    """The rank's conv pool from the global ``[L, B, x | B | C, d_conv]`` tensor: each band cut by TP."""
    d = layout.dims
    xg, bg = d.nheads * d.headdim, d.ngroups * d.d_state
    h0, h1 = layout.local_head_range()
    g0, g1 = layout.local_group_range()
    l0, l1 = layout.local_layer_range()
    bands = [global_conv[:, :, h0 * d.headdim:h1 * d.headdim],
             global_conv[:, :, xg + g0 * d.d_state:xg + g1 * d.d_state],
             global_conv[:, :, xg + bg + g0 * d.d_state:xg + bg + g1 * d.d_state]]
    return torch.cat(bands, dim=2)[l0:l1].contiguous()


def recurrent_shard(global_rec: torch.Tensor, layout: SSMShardLayout) -> torch.Tensor:
    h0, h1 = layout.local_head_range()
    l0, l1 = layout.local_layer_range()
    return global_rec[l0:l1, :, h0:h1].contiguous()


def kv_backend(layout: KVShardLayout, pool: torch.Tensor, name: str) -> LocalBackend:
    l0, l1 = layout.local_layer_range()
    return LocalBackend(
        name, pool, POOL_BLOCKS, tp_size=layout.tp_size, tp_rank=layout.tp_rank,
        num_kv_heads_global=layout.num_heads, global_rank=layout.global_rank, pp_size=layout.pp_size,
        pp_rank=layout.pp_rank, num_layers_global=layout.num_layers,
        layer_start=layout.layer_start, layer_end=None if layout.layer_start is None else l1,
    )


def byte_view(pool: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view sharing the pool's memory (any dtype, bf16 included)."""
    return pool.view(torch.uint8).reshape(-1).numpy()


def apply_copy_plan(plan: CopyPlan, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> np.ndarray:
    """What a byte transport does with a ``CopyPlan``; returns the destination byte indices written.

    Also asserts no destination byte is written twice (two rows racing).
    """
    src, dst = byte_view(src_pool), byte_view(dst_pool)
    lengths = plan.lengths.astype(np.int64)
    row = np.repeat(np.arange(lengths.size), lengths)
    within = np.arange(row.size) - (np.cumsum(lengths) - lengths)[row]
    d_idx = plan.dst_offsets[row] + within
    assert np.unique(d_idx).size == d_idx.size, "two plan rows write the same destination byte"
    dst[d_idx] = src[plan.src_offsets[row] + within]
    return d_idx


def apply_strided_rows(plan, src_pool: torch.Tensor, dst_pool: torch.Tensor) -> None:
    """What a strided transport does: row by row, fragment by fragment (test-sized plans only)."""
    src, dst = byte_view(src_pool), byte_view(dst_pool)
    for so, do, ln, cnt, ss, ds in zip(plan.src_offsets.tolist(), plan.dst_offsets.tolist(), plan.lengths.tolist(),
                                       plan.counts.tolist(), plan.src_strides.tolist(), plan.dst_strides.tolist()):
        for i in range(cnt):
            dst[do + i * ds:do + i * ds + ln] = src[so + i * ss:so + i * ss + ln]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
