"""Whole-block plans for a source checked once: the per-request planning of a prepared peer.

A decode that reads from one producer request after request (vLLM's connector) prepares the
producer's meta once (``KVTransportBackend.prepare_peer``). Most of what the general planner
(``kvxfer.plan.request``) checks per request holds for every request between one pool and one
source, so ``BlockCopier.for_pair`` checks it once:

* the pair copies whole slices: no shard layout (no TP/PP/SSM reshard, so nothing to stage);
* the slices match (``check_peer_compatible``: dtype, slice size, outer count);
* every block of either pool lies inside its exported region (``num_blocks * bytes_per_slice
  <= outer_stride_bytes``), so rows built from valid block ids never leave a region.

A request then only checks its block ids and builds its rows, in plain Python for lists up to
``FAST_IDS`` (numpy's cost per call is most of the time on the short lists requests carry).
The rows are the general planner's, row for row (``tests/unit/test_prepared_copier.py``). A pair
that fails a check gets no copier: its requests take the general planner, which refuses them
with its own words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvxfer.errors import PeerMetadataError
from kvxfer.plan.descriptors import (
    CopyPlan, IdList, check_int_ids, int_id_list, plan_checked_block_copies, small_block_rows, validate_block_ids,
)
from kvxfer.plan.geometry import BufferGeometry, PeerGeometry, check_peer_compatible
from kvxfer.plan.pool import LocalPool

#: Lists of at most this many Python ints per side are checked and planned in plain Python.
FAST_IDS = 4096
#: ... and at most this many rows before merging (else numpy, as the general planner does).
FAST_ROWS = 16384


def _blocks_inside(geometry: BufferGeometry) -> bool:
    """Every block of every outer slice lies inside the region (rows of valid ids cannot leave it)."""
    return (geometry.num_blocks >= 0 and geometry.bytes_per_slice > 0 and geometry.num_outer >= 1
            and geometry.num_blocks * geometry.bytes_per_slice <= geometry.outer_stride_bytes)


@dataclass(frozen=True)
class BlockCopier:
    """Whole-slice copies from one source's pool (``src``) into this pool (``dst``), checked once."""

    src: BufferGeometry
    dst: BufferGeometry

    @staticmethod
    def for_pair(local: LocalPool, peer: PeerGeometry) -> Optional["BlockCopier"]:
        """The copier for this pair, or None where its requests need the general planner."""
        if (local.geometry.layout is not None or peer.geometry.layout is not None
                or local.ssm_layout is not None or peer.ssm_layout is not None):
            return None  # a reshard (or a layout the general planner must judge)
        try:
            check_peer_compatible(local.geometry, local.torch_dtype, peer)
        except PeerMetadataError:
            return None
        src, dst = peer.geometry, local.geometry
        if src.bytes_per_slice != dst.bytes_per_slice or src.num_outer != dst.num_outer:
            return None
        if not (_blocks_inside(src) and _blocks_inside(dst)):
            return None
        return BlockCopier(src, dst)

    def _short_rows(self, src_ids: IdList, dst_ids: IdList) -> "tuple[list[int], list[int], list[int]] | None":
        """The rows of a short list of Python ints (``FAST_IDS``, ``FAST_ROWS``), its ids checked as the
        general planner checks them; None where the general path plans it."""
        if not (int_id_list(src_ids, FAST_IDS) and int_id_list(dst_ids, FAST_IDS)):
            return None
        check_int_ids(src_ids, dst_ids, self.src.num_blocks, self.dst.num_blocks)  # type: ignore[arg-type]
        return small_block_rows(self.src, self.dst, src_ids, dst_ids,  # type: ignore[arg-type]
                                max_rows=FAST_ROWS, check_bounds=False)

    def plan(self, src_ids: IdList, dst_ids: IdList) -> tuple[np.ndarray, np.ndarray, CopyPlan]:
        """The request's ids (as int64 arrays) and rows; raises ``BlockIdError`` as the general planner does."""
        rows = self._short_rows(src_ids, dst_ids)
        if rows is not None:
            plan = CopyPlan.from_rows(rows, len(src_ids) * self.src.num_outer)
            return np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64), plan
        s, d = validate_block_ids(src_ids, dst_ids, self.src.num_blocks, self.dst.num_blocks)
        return s, d, plan_checked_block_copies(self.src, self.dst, s, d)

    def rows(self, src_ids: IdList, dst_ids: IdList) -> "tuple[list[int], list[int], list[int]]":
        """Only the request's rows (source offsets, destination offsets, lengths) as lists of Python
        ints, for a transport that posts them itself (no numpy on the engine's hot path for a short
        request). The ids are checked exactly as ``plan`` checks them."""
        rows = self._short_rows(src_ids, dst_ids)
        if rows is None:
            copy = self.plan(src_ids, dst_ids)[2]
            rows = copy.src_offsets.tolist(), copy.dst_offsets.tolist(), copy.lengths.tolist()
        return rows
