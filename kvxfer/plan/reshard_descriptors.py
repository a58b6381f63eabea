"""Turn reshard transfers into byte descriptors every transport can post.

A reshard transfer is a rectangle in each side's pool. Per block and per outer
index (K/V x layer for KV, layer for SSM) it is a *piece*: ``per_block`` equally
spaced fragments of ``length`` bytes, at ``src_stride``/``dst_stride`` apart.
That is one fragment per block when whole slices (or SSM channel/head bands)
move, and one fragment per token when a KV head sub-range moves (the heads of one
token are contiguous, the next token is ``H_local * d`` elements further on).

Because ``per_block * stride`` is exactly one slice on each side, a run of blocks
consecutive on both sides is *one* strided row with ``count = run * per_block``.
``StridedPlan`` keeps that form (for transports with strided descriptors, e.g.
NIXL's ``(addr, len, dev, stride, count)``); ``StridedPlan.to_copy_plan()`` expands
it into the flat ``CopyPlan`` every backend can post, with numpy broadcasting and
``np.repeat`` -- no Python loop over tokens, blocks or layers. Rows whose
fragments touch (whole slices) stay one row and are coalesced as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvxfer.plan.descriptors import CopyPlan, IdList, block_runs, check_plan_bounds, coalesce, validate_block_ids
from kvxfer.errors import LayoutError, PeerMetadataError
from kvxfer.plan.geometry import BufferGeometry, PeerGeometry
from kvxfer.plan.layout import KVShardLayout
from kvxfer.plan.pool import LocalPool
from kvxfer.plan.reshard import KVReshardTransfer, kv_transfer_between
from kvxfer.plan.ssm_layout import SSMShardLayout
from kvxfer.plan.ssm_reshard import SSMReshardTransfer, ssm_transfer_between

_I64 = np.int64


@dataclass(frozen=True)
class SlicePiece:
    """One rectangle of a transfer, repeated over matching outer indices of both pools."""

    src_outer: np.ndarray  # outer indices in the source pool
    dst_outer: np.ndarray  # the matching outer indices in the destination pool
    src_inner: int  # byte offset of the first fragment inside a source slice
    dst_inner: int
    length: int  # bytes per fragment
    per_block: int  # fragments per slice
    src_stride: int  # bytes between fragments; per_block * stride == the side's slice size
    dst_stride: int



@dataclass(frozen=True)
class StridedPlan:
    """Rows of ``count`` fragments: fragment ``i`` of a row copies ``lengths`` bytes from
    ``src_offsets + i * src_strides`` to ``dst_offsets + i * dst_strides`` (offsets from each ``buf_ptr``)."""

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray
    src_strides: np.ndarray
    dst_strides: np.ndarray
    raw_descriptors: int

    @property
    def num_descriptors(self) -> int:
        return int(self.lengths.size)

    @property
    def total_bytes(self) -> int:
        return int((self.lengths * self.counts).sum())

    def to_copy_plan(self) -> CopyPlan:
        """Expand into flat rows (one per fragment unless fragments abut) and coalesce.

        Fragments of one strided row never touch each other on both sides (else the
        row would be solid), so only plans with solid rows are worth coalescing;
        skipping it for pure per-token plans halves their build time.
        """
        solid = (self.counts == 1) | ((self.lengths == self.src_strides) & (self.lengths == self.dst_strides))
        if solid.all():
            src, dst, lens = self.src_offsets, self.dst_offsets, self.lengths * self.counts
        else:
            counts = np.where(solid, 1, self.counts)
            lengths = np.where(solid, self.lengths * self.counts, self.lengths)
            if (counts == counts[0]).all():  # the common case: one count for every row, pure broadcasting
                within = np.arange(counts[0], dtype=_I64)
                src = (self.src_offsets[:, None] + within * self.src_strides[:, None]).ravel()
                dst = (self.dst_offsets[:, None] + within * self.dst_strides[:, None]).ravel()
                lens = np.repeat(lengths, counts[0])
            else:
                row = np.repeat(np.arange(counts.size, dtype=_I64), counts)
                within = np.arange(row.size, dtype=_I64) - (np.cumsum(counts) - counts)[row]
                src = self.src_offsets[row] + within * self.src_strides[row]
                dst = self.dst_offsets[row] + within * self.dst_strides[row]
                lens = lengths[row]
            if not solid.any():
                return CopyPlan(src, dst, lens, raw_descriptors=self.raw_descriptors)
        src, dst, lens = coalesce(src, dst, lens)
        return CopyPlan(src, dst, lens, raw_descriptors=self.raw_descriptors)

    @staticmethod
    def empty() -> "StridedPlan":
        none = np.zeros(0, dtype=_I64)
        return StridedPlan(none, none, none, none, none, none, 0)


def check_strided_bounds(plan: StridedPlan, src: BufferGeometry, dst: BufferGeometry) -> None:
    """No fragment of any row may leave either exported region."""
    if plan.num_descriptors == 0:
        return
    if (plan.lengths <= 0).any() or (plan.counts <= 0).any():
        raise PeerMetadataError("a planned strided copy has a non-positive length or count")
    for offsets, strides, geometry, side in ((plan.src_offsets, plan.src_strides, src, "source"),
                                             (plan.dst_offsets, plan.dst_strides, dst, "destination")):
        last = offsets + (plan.counts - 1) * strides + plan.lengths
        if (offsets < 0).any() or (strides < 0).any() or (last > geometry.region_bytes).any():
            raise PeerMetadataError(
                f"a planned copy leaves the {side} region of {geometry.region_bytes} bytes; the peer meta is inconsistent"
            )


def build_strided_plan(src: BufferGeometry, dst: BufferGeometry, pieces: Sequence[SlicePiece],
                       src_ids: np.ndarray, dst_ids: np.ndarray) -> StridedPlan:
    """Rows = pieces x outer pairs x block runs, built by broadcasting (bounds-checked)."""
    run_src, run_dst, run_len = block_runs(src_ids, dst_ids)
    if not pieces or run_len.size == 0:
        return StridedPlan.empty()
    cols: list[list[np.ndarray]] = [[] for _ in range(6)]
    raw = 0
    for p in pieces:
        assert p.per_block * p.src_stride == src.bytes_per_slice and p.per_block * p.dst_stride == dst.bytes_per_slice
        shape = (p.src_outer.size, run_len.size)
        so = p.src_outer[:, None] * src.outer_stride_bytes + run_src[None, :] * src.bytes_per_slice + p.src_inner
        do = p.dst_outer[:, None] * dst.outer_stride_bytes + run_dst[None, :] * dst.bytes_per_slice + p.dst_inner
        for col, values in zip(cols, (so, do, np.full(shape, p.length, _I64),
                                      np.broadcast_to(run_len * p.per_block, shape),
                                      np.full(shape, p.src_stride, _I64), np.full(shape, p.dst_stride, _I64))):
            col.append(values.ravel())
        fragments = 1 if p.length == p.src_stride == p.dst_stride else p.per_block
        raw += p.src_outer.size * src_ids.size * fragments
    plan = StridedPlan(*(np.concatenate(c).astype(_I64, copy=False) for c in cols), raw_descriptors=raw)
    check_strided_bounds(plan, src, dst)
    return plan


# --- KV --------------------------------------------------------------------------------------
def _kv_dims(geometry: BufferGeometry, side: str) -> tuple[KVShardLayout, int, int, int, int]:
    """(layout, L_local, tokens_per_block, heads_local, bytes per head row), checked against the geometry."""
    layout = geometry.layout
    if layout is None or geometry.tokens_per_block is None or geometry.head_dim is None:
        raise LayoutError(f"the {side} pool has no KV shard layout; register it with the full topology to reshard")
    first, last = layout.local_layer_range()
    hpp, tpb = layout.heads_per_partition, geometry.tokens_per_block
    head_bytes = geometry.head_dim * geometry.element_size
    if (geometry.num_outer != 2 * (last - first) or geometry.heads_per_partition != hpp
            or geometry.bytes_per_slice != tpb * hpp * head_bytes):
        raise PeerMetadataError(
            f"the {side} geometry (num_outer={geometry.num_outer}, bytes_per_slice={geometry.bytes_per_slice}, "
            f"heads_per_partition={geometry.heads_per_partition}) does not match its layout "
            f"(layers [{first}, {last}), {hpp} heads of {geometry.head_dim}, {tpb} tokens per block)"
        )
    return layout, last - first, tpb, hpp, head_bytes


def kv_pieces(src: BufferGeometry, dst: BufferGeometry, transfers: Sequence[KVReshardTransfer]) -> list[SlicePiece]:
    """One piece per transfer: its K and V layer planes x its head range, per token."""
    _, src_layers, tpb, src_heads, head_bytes = _kv_dims(src, "source")
    _, dst_layers, dst_tpb, dst_heads, dst_head_bytes = _kv_dims(dst, "destination")
    if (tpb, head_bytes) != (dst_tpb, dst_head_bytes):
        raise PeerMetadataError(
            f"source has {tpb} tokens per block and {head_bytes} B per head, destination {dst_tpb} and "
            f"{dst_head_bytes}; reshard moves heads, not tokens or head_dim"
        )
    pieces = []
    for t in transfers:
        layers = np.arange(t.num_layers, dtype=_I64)
        pieces.append(SlicePiece(
            src_outer=np.concatenate((layers + t.src_layer_offset, layers + src_layers + t.src_layer_offset)),
            dst_outer=np.concatenate((layers + t.dst_layer_offset, layers + dst_layers + t.dst_layer_offset)),
            src_inner=t.src_head_offset * head_bytes, dst_inner=t.dst_head_offset * head_bytes,
            length=t.num_heads * head_bytes, per_block=tpb,
            src_stride=src_heads * head_bytes, dst_stride=dst_heads * head_bytes,
        ))
    return pieces


def plan_kv_reshard_strided(src: BufferGeometry, dst: BufferGeometry, transfers: Sequence[KVReshardTransfer],
                            src_ids: IdList, dst_ids: IdList) -> StridedPlan:
    """Strided rows for the KV ``transfers`` of one (src, dst) pair."""
    s, d = validate_block_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks)
    return build_strided_plan(src, dst, kv_pieces(src, dst, transfers), s, d)


def plan_kv_reshard_copies(src: BufferGeometry, dst: BufferGeometry, transfers: Sequence[KVReshardTransfer],
                           src_ids: IdList, dst_ids: IdList) -> CopyPlan:
    """Flat, coalesced, bounds-checked byte rows for the KV ``transfers`` of one (src, dst) pair."""
    plan = plan_kv_reshard_strided(src, dst, transfers, src_ids, dst_ids).to_copy_plan()
    check_plan_bounds(plan, src, dst)
    return plan


# --- SSM -------------------------------------------------------------------------------------
def _ssm_check(geometry: BufferGeometry, layout: SSMShardLayout, kind: str, side: str) -> None:
    shape = layout.state_shape(kind, geometry.num_blocks)
    if geometry.num_outer != shape[0] or geometry.bytes_per_slice != int(np.prod(shape[2:])) * geometry.element_size:
        raise PeerMetadataError(
            f"the {side} {kind} geometry (num_outer={geometry.num_outer}, bytes_per_slice={geometry.bytes_per_slice}) "
            f"does not match its SSM layout (pool shape {shape})"
        )


def ssm_pieces(src: BufferGeometry, src_layout: SSMShardLayout, dst: BufferGeometry, dst_layout: SSMShardLayout,
               kind: str, transfers: Sequence[SSMReshardTransfer]) -> list[SlicePiece]:
    """Conv: up to three channel bands per transfer; recurrent: one head range per transfer."""
    _ssm_check(src, src_layout, kind, "source")
    _ssm_check(dst, dst_layout, kind, "destination")
    dims, es = src_layout.dims, src.element_size
    pieces = []
    for t in transfers:
        layers = np.arange(t.num_layers, dtype=_I64)
        common = dict(src_outer=layers + t.src_layer_offset, dst_outer=layers + t.dst_layer_offset, per_block=1,
                      src_stride=src.bytes_per_slice, dst_stride=dst.bytes_per_slice)
        if kind == "conv":
            row = dims.d_conv * es  # one channel's d_conv taps
            for ch in t.conv_channel_ranges(src_layout, dst_layout):
                pieces.append(SlicePiece(src_inner=ch.src_channel * row, dst_inner=ch.dst_channel * row,
                                         length=ch.num_channels * row, **common))
        else:
            head = dims.headdim * dims.d_state * es
            pieces.append(SlicePiece(src_inner=t.src_head_offset * head, dst_inner=t.dst_head_offset * head,
                                     length=t.num_heads * head, **common))
    return pieces


def plan_ssm_reshard_strided(src: BufferGeometry, src_layout: SSMShardLayout, dst: BufferGeometry,
                             dst_layout: SSMShardLayout, kind: str, transfers: Sequence[SSMReshardTransfer],
                             src_ids: IdList, dst_ids: IdList) -> StridedPlan:
    s, d = validate_block_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks)
    return build_strided_plan(src, dst, ssm_pieces(src, src_layout, dst, dst_layout, kind, transfers), s, d)


def plan_ssm_reshard_copies(src: BufferGeometry, src_layout: SSMShardLayout, dst: BufferGeometry,
                            dst_layout: SSMShardLayout, kind: str, transfers: Sequence[SSMReshardTransfer],
                            src_ids: IdList, dst_ids: IdList) -> CopyPlan:
    """Flat, coalesced, bounds-checked byte rows for the SSM ``transfers`` of one (src, dst) pair."""
    plan = plan_ssm_reshard_strided(src, src_layout, dst, dst_layout, kind, transfers, src_ids, dst_ids).to_copy_plan()
    check_plan_bounds(plan, src, dst)
    return plan


# --- what kvxfer.plan.request calls for one (local pool, peer) pair --------------------------------
def reshard_transfers_for_pull(local: LocalPool, peer: PeerGeometry) -> Optional[list]:
    """The transfers pool ``local`` reads from ``peer``, or None when this is not a reshard pull.

    A reshard pull is one where both sides carry a layout of the same kind (KV
    ``geometry.layout``, or ``ssm_layout`` + ``ssm_state_kind``). Checks dtype and
    model identity; raises ``PeerMetadataError`` / ``LayoutError``.
    """
    ours_ssm, theirs_ssm = local.ssm_layout, peer.ssm_layout
    if isinstance(ours_ssm, SSMShardLayout) and isinstance(theirs_ssm, SSMShardLayout):
        kind = "SSM"
    elif ours_ssm is None and theirs_ssm is None and local.geometry.layout is not None and peer.geometry.layout is not None:
        kind = "KV"
    else:
        return None
    if peer.dtype != local.dtype:
        raise PeerMetadataError(f"peer dtype is {peer.dtype}, ours is {local.dtype}; both sides must use the same {kind} dtype")
    if kind == "SSM":
        if peer.ssm_state_kind != local.ssm_state_kind:
            raise PeerMetadataError(f"peer holds SSM {peer.ssm_state_kind} state, this pool holds {local.ssm_state_kind}")
        src, dst = theirs_ssm, ours_ssm
        between = ssm_transfer_between
    else:
        src, dst = peer.geometry.layout, local.geometry.layout
        between = kv_transfer_between
    if src.model_key() != dst.model_key():
        raise LayoutError(f"peer layout describes {src.model_key()}, ours {dst.model_key()}; not the same model")
    transfer = between(src, dst)
    return [] if transfer is None else [transfer]


def plan_reshard_pull_strided(local: LocalPool, peer: PeerGeometry, src_ids: IdList, dst_ids: IdList) -> Optional[StridedPlan]:
    """Strided rows for a reshard pull into pool ``local`` from ``peer``, or None if not a reshard pull.

    For transports with strided descriptors (a NIXL backend can post these rows from
    ``_post_read`` instead of ``pull.plan``: same bytes, far fewer rows).
    """
    transfers = reshard_transfers_for_pull(local, peer)
    if transfers is None:
        return None
    if isinstance(local.ssm_layout, SSMShardLayout):
        return plan_ssm_reshard_strided(peer.geometry, peer.ssm_layout, local.geometry, local.ssm_layout,
                                        local.ssm_state_kind, transfers, src_ids, dst_ids)
    return plan_kv_reshard_strided(peer.geometry, local.geometry, transfers, src_ids, dst_ids)


def plan_reshard_pull(local: LocalPool, peer: PeerGeometry, src_ids: IdList, dst_ids: IdList) -> Optional[CopyPlan]:
    """Flat byte plan for a reshard pull into pool ``local`` from ``peer``, or None if not a reshard pull.

    What ``kvxfer.plan.request.plan_pull`` returns for reshard pulls. An empty plan
    means the peer holds nothing this rank needs.
    """
    strided = plan_reshard_pull_strided(local, peer, src_ids, dst_ids)
    if strided is None:
        return None
    plan = strided.to_copy_plan()
    check_plan_bounds(plan, peer.geometry, local.geometry)
    return plan
