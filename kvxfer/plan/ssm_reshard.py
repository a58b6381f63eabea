"""Plan who reads which SSM state slices when prefill and decode use different TP/PP.

The SSM counterpart of ``kvxfer.plan.reshard`` (same validation, same replica rule,
same "every rank computes the whole plan and keeps its own part"). The one new
thing is the conv state: its channels are three bands (x, B, C) each split by TP
on its own (see ``kvxfer.plan.ssm_layout``), so one (src, dst) pair moves up to three
separate channel ranges per slot. Because heads and groups split by the same
TP fraction, a pair that shares heads always shares groups too, and vice versa.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvxfer.errors import LayoutError
from kvxfer.plan.reshard import (
    LayerHeadSlices, check_same_model, check_tiling, dedupe_sources, intersect, overlap, pair_transfers,
)
from kvxfer.plan.ssm_layout import CONV_BANDS, SSMShardLayout


@dataclass(frozen=True)
class ChannelRange:
    """One contiguous run of conv channels: where it starts in each side's slot, and how many."""

    band: str
    src_channel: int
    dst_channel: int
    num_channels: int


@dataclass(frozen=True)
class SSMReshardTransfer(LayerHeadSlices):
    """Layers x heads (and the matching groups) a destination rank reads from a source rank."""

    src_rank: int
    dst_rank: int
    layer_start: int
    layer_end: int
    head_start: int
    head_end: int
    group_start: int
    group_end: int
    src_layer_offset: int
    dst_layer_offset: int
    src_head_offset: int
    dst_head_offset: int
    src_group_offset: int
    dst_group_offset: int

    @property
    def num_groups(self) -> int:
        return self.group_end - self.group_start

    def conv_channel_ranges(self, src: SSMShardLayout, dst: SSMShardLayout) -> list[ChannelRange]:
        """The x, B and C channel runs of this transfer inside each side's conv slot."""
        hd, ds = src.dims.headdim, src.dims.d_state
        out = [ChannelRange("x", self.src_head_offset * hd, self.dst_head_offset * hd, self.num_heads * hd)]
        for i, band in enumerate(CONV_BANDS[1:]):
            src_base = src.nheads_local * hd + i * src.ngroups_local * ds
            dst_base = dst.nheads_local * hd + i * dst.ngroups_local * ds
            out.append(ChannelRange(band, src_base + self.src_group_offset * ds,
                                    dst_base + self.dst_group_offset * ds, self.num_groups * ds))
        return out


def ssm_transfer_between(src: SSMShardLayout, dst: SSMShardLayout) -> SSMReshardTransfer | None:
    """The one rectangle ``dst`` can read from ``src`` (no replica logic), or None."""
    both = overlap(src, dst)
    if both is None:
        return None
    (l0, l1), (h0, h1) = both
    groups = intersect(src.local_group_range(), dst.local_group_range())
    assert groups is not None, "heads and groups split by the same TP fraction"
    g0, g1 = groups
    return SSMReshardTransfer(
        src_rank=src.global_rank, dst_rank=dst.global_rank,
        layer_start=l0, layer_end=l1, head_start=h0, head_end=h1, group_start=g0, group_end=g1,
        src_layer_offset=l0 - src.local_layer_range()[0], dst_layer_offset=l0 - dst.local_layer_range()[0],
        src_head_offset=h0 - src.local_head_range()[0], dst_head_offset=h0 - dst.local_head_range()[0],
        src_group_offset=g0 - src.local_group_range()[0], dst_group_offset=g0 - dst.local_group_range()[0],
    )


def plan_ssm_reshard(srcs: Sequence[SSMShardLayout], dsts: Sequence[SSMShardLayout]) -> list[SSMReshardTransfer]:
    """Every transfer that moves the prefill side's SSM state into the decode side's.

    Validates first (same model and dims, each side tiles layers x heads);
    raises ``LayoutError``. Ordered by destination rank, then source rank.
    """
    srcs, dsts = list(srcs), list(dsts)
    for layout in (*srcs, *dsts):
        if not isinstance(layout, SSMShardLayout):
            raise LayoutError(f"plan_ssm_reshard takes SSMShardLayouts, got {type(layout).__name__}")
    if not srcs or not dsts:
        raise LayoutError("plan_ssm_reshard needs at least one source and one destination layout")
    check_same_model(srcs, dsts)
    check_tiling(srcs, dsts, srcs[0].dims.nheads)
    return pair_transfers(dedupe_sources(srcs), dsts, ssm_transfer_between)
