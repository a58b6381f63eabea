"""Plan a head-sharded KV reshard as whole-slice reads into staging plus one local placement.

A direct reshard read posts one descriptor per token fragment: with
``[2, L, B, T, H, d]`` pools the heads of one token are contiguous, the next token's
are ``H_local * d`` elements further on, so moving a head sub-range (TP 2 -> 1 or
1 -> 2) is ``T`` small fragments per block and layer. Transports pay per
descriptor, and reshard ran at a tenth of a plain pull.

Staged instead, the reader fetches the source's *whole* slices for the layers it
needs (the same coalesced descriptors a plain pull uses) into a staging region laid
out ``[2, n_layers, n_blocks, T, H_src, d]``, then places the heads it needs with one
strided tensor copy on the destination's own device. It reads the source's other
heads too when it needs only some of them (TP 1 -> 2 reads twice the bytes), which
is still far cheaper than thousands of 1 KiB reads.

Pure planning: byte offsets and tensor index ranges, no transport and no tensors
(the placement itself, one torch operation, is ``kvxfer.backends.staged.apply_placement``).
Staging is bounded: a request is split into chunks of blocks that fit
``max_staging_bytes``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvxfer.errors import LayoutError
from kvxfer.plan.descriptors import CopyPlan, block_runs, coalesce
from kvxfer.plan.geometry import BufferGeometry
from kvxfer.plan.reshard import KVReshardTransfer
from kvxfer.plan.reshard_descriptors import kv_pieces

#: A head fragment at least this long is read directly: its descriptors are already large.
DIRECT_FRAGMENT_BYTES = 16 * 1024
#: Default bound on the staging region of one backend (``KVXFER_STAGING_BYTES`` overrides it:
#: ``kvxfer.backends.staging.staging_bytes_from_env``).
DEFAULT_STAGING_BYTES = 64 * 1024 * 1024

_I64 = np.int64


@dataclass(frozen=True)
class Placement:
    """Where one transfer's staged slices go: ``pool[:, dst_layers, dst_ids, :, dst_heads] =
    staging[offset:][2, n_layers, n_blocks, T, H_src, d][..., src_heads, :]``."""

    transfer: KVReshardTransfer
    staging_offset: int  # bytes
    dst_ids: np.ndarray
    src_heads_local: int  # H of the source pool (the staged slice's head count)


@dataclass(frozen=True)
class StagedChunk:
    """One round: read ``read`` (dst offsets are into the staging region), then apply ``placements``."""

    read: CopyPlan
    staging_bytes: int
    placements: tuple[Placement, ...]


def fragment_bytes(transfer: KVReshardTransfer, geometry: BufferGeometry) -> int:
    """Bytes of one token's head run in a direct read of ``transfer``."""
    return transfer.num_heads * (geometry.head_dim or 0) * geometry.element_size


def staging_pays(transfers: Sequence[KVReshardTransfer], src: BufferGeometry, dst: BufferGeometry) -> bool:
    """Staging wins when a direct read would split slices into small per-token fragments."""
    for t in transfers:
        whole = t.num_heads == src.heads_per_partition == dst.heads_per_partition
        if not whole and fragment_bytes(t, src) < DIRECT_FRAGMENT_BYTES:
            return True
    return False


def plan_staged_kv(src: BufferGeometry, dst: BufferGeometry, transfers: Sequence[KVReshardTransfer],
                   src_ids: np.ndarray, dst_ids: np.ndarray, max_staging_bytes: int) -> list[StagedChunk]:
    """Chunks of whole-slice reads and placements covering every transfer for every block."""
    if src.layout is None or dst.layout is None or src.tokens_per_block is None:
        raise LayoutError("a staged reshard needs KV layouts on both pools")
    kv_pieces(src, dst, transfers)  # the same geometry/layout consistency checks as a direct reshard
    slice_bytes = src.bytes_per_slice
    src_layers = src.num_outer // 2
    per_block = sum(2 * t.num_layers for t in transfers) * slice_bytes  # staged bytes per block, all transfers
    if per_block == 0 or src_ids.size == 0:
        return []
    if per_block > max_staging_bytes:
        raise LayoutError(
            f"one block needs {per_block} B of staging but the staging region holds {max_staging_bytes} B; "
            "raise the staging size or read directly"
        )
    blocks_per_chunk = max(1, max_staging_bytes // per_block)
    chunks = []
    for start in range(0, src_ids.size, blocks_per_chunk):
        s_ids, d_ids = src_ids[start:start + blocks_per_chunk], dst_ids[start:start + blocks_per_chunk]
        chunks.append(_chunk(src, transfers, s_ids, d_ids, slice_bytes, src_layers))
    return chunks


def _chunk(src: BufferGeometry, transfers: Sequence[KVReshardTransfer], s_ids: np.ndarray, d_ids: np.ndarray,
           slice_bytes: int, src_layers: int) -> StagedChunk:
    run_src, run_pos, run_len = block_runs(s_ids, np.arange(s_ids.size, dtype=_I64))
    n = s_ids.size
    src_off, dst_off, lens, placements = [], [], [], []
    offset = 0
    for t in transfers:
        layers = np.arange(t.num_layers, dtype=_I64)
        outers = np.concatenate((layers + t.src_layer_offset, layers + src_layers + t.src_layer_offset))
        staged_outer = np.arange(outers.size, dtype=_I64)  # staging is [2 * n_layers, n, slice]
        so = outers[:, None] * src.outer_stride_bytes + run_src[None, :] * slice_bytes
        do = offset + (staged_outer[:, None] * n + run_pos[None, :]) * slice_bytes
        src_off.append(so.ravel())
        dst_off.append(do.ravel())
        lens.append(np.broadcast_to(run_len * slice_bytes, so.shape).ravel())
        placements.append(Placement(t, offset, d_ids, src.heads_per_partition))
        offset += outers.size * n * slice_bytes
    s, d, ln = coalesce(*(np.concatenate(x).astype(_I64, copy=False) for x in (src_off, dst_off, lens)))
    raw = int(sum(2 * t.num_layers for t in transfers) * n * (src.tokens_per_block or 1))
    return StagedChunk(CopyPlan(s, d, ln, raw_descriptors=raw), offset, tuple(placements))
