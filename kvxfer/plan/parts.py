"""Reads of byte ranges inside each block: a block's *parts*, not the whole slice.

A whole-slice copy needs both pools to cut their blocks the same way. Some pairs cannot: a
hybrid model's page on a prefill with tensor parallelism ``P`` holds a different share of each
state than the page of a decode with ``D`` (``kvxfer.integrations.vllm.hybrid_tp``), so a decode
page is filled from byte ranges of the prefill's: a head range of an attention block, the x, B
and C channel bands and a head range of a Mamba state. ``SlicePart`` names one such range on
both sides; every block pair and every outer index (layer slot) moves the same parts.

Pure planning, checked before anything is posted: every part lies inside one slice on both
sides (so no read spills into the neighbouring block), the block ids lie inside both pools, and
the rows are bounds-checked against both regions, as every plan is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvxfer.errors import PeerMetadataError
from kvxfer.plan.descriptors import CopyPlan, IdList, check_plan_bounds, validate_block_ids
from kvxfer.plan.geometry import BufferGeometry
from kvxfer.plan.reshard_descriptors import SlicePiece, build_strided_plan

#: More parts per block than any layout needs (an SD conv state is 3 bands per row): a bound on
#: what one request may ask the planner to build.
MAX_PARTS = 4096


@dataclass(frozen=True)
class SlicePart:
    """Bytes ``[src_offset, src_offset + length)`` of a source block land at ``dst_offset`` of the
    destination block (offsets from each block's first byte, in every outer slice)."""

    src_offset: int
    dst_offset: int
    length: int


def check_parts(parts: Sequence[SlicePart], src: BufferGeometry, dst: BufferGeometry) -> None:
    """``PeerMetadataError`` unless the parts fit one slice on each side and the pools pair up."""
    if not parts or len(parts) > MAX_PARTS:
        raise PeerMetadataError(f"a block-part read needs 1..{MAX_PARTS} parts, got {len(parts)}")
    if src.num_outer != dst.num_outer:
        raise PeerMetadataError(f"the source has {src.num_outer} outer slices (layer slots), the destination "
                                f"{dst.num_outer}; a block-part read moves the same parts of each")
    for part in parts:
        if not isinstance(part, SlicePart) or min(part.src_offset, part.dst_offset) < 0 or part.length <= 0 \
                or part.src_offset + part.length > src.bytes_per_slice \
                or part.dst_offset + part.length > dst.bytes_per_slice:
            raise PeerMetadataError(
                f"block part {part!r} leaves a block (source blocks are {src.bytes_per_slice} B, destination "
                f"blocks {dst.bytes_per_slice} B)")


def plan_slice_parts(src: BufferGeometry, dst: BufferGeometry, src_ids: IdList, dst_ids: IdList,
                     parts: Sequence[SlicePart]) -> tuple[np.ndarray, np.ndarray, CopyPlan]:
    """The checked ids and the rows that move ``parts`` of each block ``src_ids[i]`` into ``dst_ids[i]``,
    in every outer slice; raises (``BlockIdError``, ``PeerMetadataError``) before anything is posted."""
    check_parts(parts, src, dst)
    s, d = validate_block_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks)
    outer = np.arange(src.num_outer, dtype=np.int64)
    pieces = [SlicePiece(src_outer=outer, dst_outer=outer, src_inner=p.src_offset, dst_inner=p.dst_offset,
                         length=p.length, per_block=1, src_stride=src.bytes_per_slice,
                         dst_stride=dst.bytes_per_slice) for p in parts]
    plan = build_strided_plan(src, dst, pieces, s, d).to_copy_plan()
    check_plan_bounds(plan, src, dst)
    return s, d, plan
