"""Byte runs that move a range of KV heads of one block between two vLLM per-layer layouts.

With equal TP a whole block is read; with different TP a decode rank reads *some* heads of a
prefill rank's block into *some* heads of its own, and where those bytes sit depends on vLLM's
per-layer layout. vLLM 0.32 hands every attention layer as a 4-D view ``[blocks, heads,
block_size, 2*head_size]`` (K then V in the last axis) whose strides follow
``KVCacheLayout`` (``v1/kv_cache_layout.py``, ``create_kv_cache_views``): ``LBHNC`` ("HND",
the CPU backend's only layout: a head's tokens contiguous inside a block) or ``LBNHC``
("NHD": a token's heads contiguous). Older flash-attention tensors ``[2, blocks, block_size,
heads, head_size]`` are the same problem with an outer K/V axis. Nothing here assumes one of
them: a layout is (shape, strides, blocks axis, heads axis), and the runs are computed from the
strides, so the same code is exact for each (tests compare with torch slicing).

Both sides enumerate the head box in one order (the source's memory order) and pair element by
element; a run is the longest stretch contiguous on *both* sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvxfer.errors import LayoutError


@dataclass(frozen=True)
class LayerLayout:
    """One rank's per-layer KV view: ``shape`` and ``strides`` in elements of ``itemsize`` bytes."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    blocks_axis: int
    heads_axis: int

    @property
    def block_stride_bytes(self) -> int:
        return self.strides[self.blocks_axis] * self.itemsize

    @property
    def num_heads(self) -> int:
        return self.shape[self.heads_axis]

    def name(self) -> str:
        """``LBHNC``/``LBNHC`` for vLLM 0.32's 4-D views, else the axis order in memory."""
        order = sorted(range(len(self.shape)), key=lambda i: -self.strides[i])
        if len(self.shape) == 4 and (self.blocks_axis, self.heads_axis) == (0, 1) and order[0] == 0:
            return "LBHNC" if order.index(1) < order.index(2) else "LBNHC"
        labels = {self.blocks_axis: "B", self.heads_axis: "H"}
        return "".join(labels.get(i, f"d{i}") for i in order) + f"{list(self.shape)}"


def _offsets(sizes: list[int], strides: list[int]) -> np.ndarray:
    """Element offsets of every index of a box, first axis slowest."""
    out = np.zeros(1, dtype=np.int64)
    for size, stride in zip(sizes, strides):
        out = (out[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    return out


def head_runs(src: LayerLayout, dst: LayerLayout, src_head: int, dst_head: int, num_heads: int) -> np.ndarray:
    """``[n, 3]`` int64 rows ``(src_offset, dst_offset, length)`` in bytes, offsets from each side's
    block start, that copy heads ``src_head..+num_heads`` of a source block to ``dst_head..`` of a
    destination block. Raises ``LayoutError`` if the two views do not hold the same per-head data."""
    if src.itemsize != dst.itemsize or len(src.shape) != len(dst.shape) or \
            (src.blocks_axis, src.heads_axis) != (dst.blocks_axis, dst.heads_axis):
        raise LayoutError(f"KV views differ beyond their heads: {src.name()} vs {dst.name()}")
    axes = [i for i in range(len(src.shape)) if i != src.blocks_axis]
    for i in axes:
        if i != src.heads_axis and src.shape[i] != dst.shape[i]:
            raise LayoutError(f"KV views differ beyond their heads: {src.name()} vs {dst.name()}")
    if not (0 <= src_head and src_head + num_heads <= src.num_heads and 0 <= dst_head
            and dst_head + num_heads <= dst.num_heads and num_heads > 0):
        raise LayoutError(f"heads {src_head}+{num_heads} -> {dst_head}+{num_heads} outside {src.name()} / {dst.name()}")
    box = {i: (num_heads if i == src.heads_axis else src.shape[i]) for i in axes}
    order = sorted((i for i in axes if box[i] > 1), key=lambda i: (-src.strides[i], -dst.strides[i], i))
    inner, run = len(order), 1
    while inner > 0 and src.strides[order[inner - 1]] == run and dst.strides[order[inner - 1]] == run:
        inner -= 1
        run *= box[order[inner]]
    outer = order[:inner]
    sizes = [box[i] for i in outer]
    s_off = _offsets(sizes, [src.strides[i] for i in outer]) + src_head * src.strides[src.heads_axis]
    d_off = _offsets(sizes, [dst.strides[i] for i in outer]) + dst_head * dst.strides[dst.heads_axis]
    rows = np.stack([s_off, d_off, np.full_like(s_off, run)], axis=1) * src.itemsize
    return _merge(rows)


def _merge(rows: np.ndarray) -> np.ndarray:
    """Join consecutive rows that continue each other on both sides."""
    if len(rows) < 2:
        return rows
    joins = (rows[1:, 0] == rows[:-1, 0] + rows[:-1, 2]) & (rows[1:, 1] == rows[:-1, 1] + rows[:-1, 2])
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    ends = np.concatenate([starts[1:], [len(rows)]])
    lengths = np.add.reduceat(rows[:, 2], starts)
    return np.stack([rows[starts, 0], rows[starts, 1], lengths], axis=1) if len(ends) else rows
