"""Descriptors from a ``CopyPlan``: prepared per-slice lists and their indices, or plain Nx3 rows.

Why prepared lists come first: the backend module's docstring ("Descriptors").
"""

from __future__ import annotations

import numpy as np

from kvxfer.plan.descriptors import CopyPlan
from kvxfer.plan.geometry import BufferGeometry

#: Above this many (outer slice, block) entries a per-slice prepared list costs more
#: memory than it saves time; such pools post Nx3 rows instead.
MAX_PREPPED_ENTRIES = 1 << 22


def slice_rows(geometry: BufferGeometry) -> np.ndarray:
    """``num_outer`` strided rows ``(addr, len, dev, stride, count)`` covering every
    (outer, block) slice: entry ``outer * num_blocks + block`` of the expanded list."""
    g = geometry
    rows = np.empty((g.num_outer, 5), dtype=np.uint64)
    rows[:, 0] = g.buf_ptr + np.arange(g.num_outer, dtype=np.uint64) * np.uint64(g.outer_stride_bytes)
    rows[:, 1] = g.bytes_per_slice
    rows[:, 2] = g.device_id
    rows[:, 3] = g.bytes_per_slice
    rows[:, 4] = g.num_blocks
    return rows


def slice_indices(plan: CopyPlan, bytes_per_slice: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-slice list indices ``(src, dst)`` for a plan whose rows are whole slices.

    A row of ``n`` slices becomes ``n`` consecutive indices (array ops only).
    """
    n = plan.lengths // bytes_per_slice
    src0 = plan.src_offsets // bytes_per_slice
    dst0 = plan.dst_offsets // bytes_per_slice
    if n.size == 0 or (n == 1).all():
        return src0.astype(np.int32), dst0.astype(np.int32)
    step = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return (np.repeat(src0, n) + step).astype(np.int32), (np.repeat(dst0, n) + step).astype(np.int32)


def plan_is_slice_aligned(plan: CopyPlan, local: BufferGeometry, remote: BufferGeometry) -> bool:
    bps = local.bytes_per_slice
    if remote.bytes_per_slice != bps:
        return False
    for g in (local, remote):
        if g.num_outer * g.num_blocks > MAX_PREPPED_ENTRIES:
            return False
    return not ((plan.src_offsets % bps).any() or (plan.dst_offsets % bps).any() or (plan.lengths % bps).any())


def plan_rows(base: int, offsets: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    rows = np.empty((lengths.size, 3), dtype=np.uint64)
    rows[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    rows[:, 1] = lengths
    rows[:, 2] = device_id
    return rows
