"""The ``local`` oracle's reshard: tensor views, never byte plans.

Each transfer is one indexed tensor copy on the pools' logical shapes, e.g. for KV
``dst[:, dst_layers, dst_ids, :, dst_heads] = src[:, src_layers, src_ids, :, src_heads]``.
The SSM conv bands are cut out of each pool here with their own arithmetic (not
``SSMReshardTransfer.conv_channel_ranges``), so the byte planner and the oracle
do not share that code and cannot share its bugs.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


def _conv_bands(pool: torch.Tensor, layout: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the x, B, C bands of a conv pool ``[L, B, channels_local, d_conv]``, channels split per head / group."""
    hd, ds = layout.dims.headdim, layout.dims.d_state
    x, b, c = torch.split(pool, [layout.nheads_local * hd, layout.ngroups_local * ds, layout.ngroups_local * ds], dim=2)
    return (x.unflatten(2, (layout.nheads_local, hd)), b.unflatten(2, (layout.ngroups_local, ds)),
            c.unflatten(2, (layout.ngroups_local, ds)))


def copy_resharded(source: Any, dest: Any, transfers: Sequence[Any], src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """Apply ``transfers`` from backend ``source`` into backend ``dest`` for the given block ids."""
    src, dst = source.memory_buffer, dest.memory_buffer
    s_ids = torch.from_numpy(np.ascontiguousarray(src_ids)).to(src.device)
    d_ids = torch.from_numpy(np.ascontiguousarray(dst_ids)).to(dst.device)
    kind = dest.ssm_state_kind
    for t in transfers:
        if kind is None:  # KV [2, L, B, T, H, d]
            dst[:, t.dst_layers, d_ids, :, t.dst_heads] = src[:, t.src_layers, s_ids, :, t.src_heads].to(dst.device)
        elif kind == "recurrent":  # [L, B, H, headdim, d_state]
            dst[t.dst_layers, d_ids, t.dst_heads] = src[t.src_layers, s_ids, t.src_heads].to(dst.device)
        else:  # conv [L, B, channels, d_conv], as x / B / C bands
            src_groups = slice(t.src_group_offset, t.src_group_offset + t.num_groups)
            dst_groups = slice(t.dst_group_offset, t.dst_group_offset + t.num_groups)
            pairs = zip(_conv_bands(src, source.ssm_layout), _conv_bands(dst, dest.ssm_layout),
                        ((t.src_heads, t.dst_heads), (src_groups, dst_groups), (src_groups, dst_groups)))
            for s_band, d_band, (s_sel, d_sel) in pairs:
                # assigning through the band view writes into the pool itself
                d_band[t.dst_layers, d_ids, d_sel] = s_band[t.src_layers, s_ids, s_sel].to(dst.device)
