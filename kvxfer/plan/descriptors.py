"""Turn (geometry pair, block ids) into the byte ranges a transport must copy.

The reference issues one descriptor per (block, outer slice). Here adjacent blocks
become one run, runs become one row per outer slice, and rows that touch on both
sides merge again, all with numpy array operations: the Python work does not grow
with blocks x layers. A short request (``SMALL_IDS`` ids, ``SMALL_ROWS`` rows: what a vLLM
handoff or a lease read is) is planned in plain Python instead, where numpy's cost per call
would be most of the time; both paths give the same plan (a property test keeps them equal).
The plan is pure data; backends post it however their
transport likes (rows, strided rows, prepared-list indices).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import count, groupby
from operator import sub
from typing import Sequence

import numpy as np

from kvxfer.errors import BlockIdError, PeerMetadataError
from kvxfer.plan.geometry import BufferGeometry

IdList = Sequence[int] | np.ndarray

#: At most this many ids per side, and rows before merging, are planned in plain Python.
SMALL_IDS = 64
SMALL_ROWS = 512


@dataclass(frozen=True)
class CopyPlan:
    """Byte ranges to copy, as offsets from each side's ``buf_ptr``.

    ``raw_descriptors`` is what a naive per-(block, outer slice) plan would post,
    kept so users can see what coalescing saved.
    """

    src_offsets: np.ndarray
    dst_offsets: np.ndarray
    lengths: np.ndarray
    raw_descriptors: int

    @property
    def num_descriptors(self) -> int:
        return int(self.lengths.size)

    @cached_property
    def total_bytes(self) -> int:
        """Summed once: a request's bookkeeping asks several times, and numpy's sum is costly on short rows."""
        return int(self.lengths.sum())

    @staticmethod
    def from_rows(rows: "tuple[list[int], list[int], list[int]]", raw_descriptors: int) -> "CopyPlan":
        """A plan of rows built in plain Python (``small_block_rows``), its byte total summed there too."""
        src_off, dst_off, lengths = rows
        plan = CopyPlan(np.array(src_off, dtype=np.int64), np.array(dst_off, dtype=np.int64),
                        np.array(lengths, dtype=np.int64), raw_descriptors)
        plan.__dict__["total_bytes"] = sum(lengths)  # seeds the cached property: cheaper in Python than numpy
        return plan

    @staticmethod
    def empty() -> "CopyPlan":
        none = np.zeros(0, dtype=np.int64)
        return CopyPlan(none, none, none, 0)


def _as_ids(ids: IdList, side: str) -> np.ndarray:
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:
        raise BlockIdError(f"{side} block ids are not a list of ints: {exc}") from None
    if arr.ndim != 1:
        raise BlockIdError(f"{side} block ids must be a flat list, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise BlockIdError(f"{side} block ids must be ints, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def validate_block_ids(src_ids: IdList, dst_ids: IdList, src_num_blocks: int, dst_num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Check two block-id lists before anything is posted; return them as int64 arrays.

    Equal lengths, every id inside its pool, and no id twice on either side (two
    reads landing in one destination block would race; a repeated source id is a
    caller bug that would otherwise go unnoticed).
    """
    if _small_int_list(src_ids) and _small_int_list(dst_ids):
        return _validate_small(src_ids, dst_ids, src_num_blocks, dst_num_blocks)  # type: ignore[arg-type]
    src, dst = _as_ids(src_ids, "source"), _as_ids(dst_ids, "destination")
    if src.size != dst.size:
        raise BlockIdError(f"{src.size} source block ids but {dst.size} destination block ids; pass one of each per block")
    for arr, side, limit in ((src, "source", src_num_blocks), (dst, "destination", dst_num_blocks)):
        if arr.size == 0:
            continue
        low, high = int(arr.min()), int(arr.max())
        if low < 0 or high >= limit:
            bad = (arr < 0) | (arr >= limit)
            raise BlockIdError(f"{side} block id {int(arr[bad][0])} is outside the pool's [0, {limit})")
        if not _distinct(arr):
            values, counts = np.unique(arr, return_counts=True)
            raise BlockIdError(f"{side} block id {int(values[counts > 1][0])} appears more than once")
    return src, dst


def _small_int_list(ids: IdList) -> bool:
    return int_id_list(ids, SMALL_IDS)


def _validate_small(src: Sequence[int], dst: Sequence[int], src_num_blocks: int,
                    dst_num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """``validate_block_ids`` for short lists of Python ints: the same checks and messages, in Python."""
    check_int_ids(src, dst, src_num_blocks, dst_num_blocks)
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


_INT_TYPE = {int}  # exactly int: a bool is not a block id


def int_id_list(ids: IdList, limit: int) -> bool:
    """``ids`` is a list or tuple of at most ``limit`` Python ints (what plain-Python planning takes)."""
    return isinstance(ids, (list, tuple)) and len(ids) <= limit and {*map(type, ids)} <= _INT_TYPE  # C-level walk


def check_int_ids(src: Sequence[int], dst: Sequence[int], src_num_blocks: int, dst_num_blocks: int) -> None:
    """``validate_block_ids``'s checks and messages for lists of Python ints, without building arrays."""
    if len(src) != len(dst):
        raise BlockIdError(f"{len(src)} source block ids but {len(dst)} destination block ids; pass one of each per block")
    for ids, side, limit in ((src, "source", src_num_blocks), (dst, "destination", dst_num_blocks)):
        if not ids:
            continue
        if min(ids) < 0 or max(ids) >= limit:
            bad = next(x for x in ids if x < 0 or x >= limit)
            raise BlockIdError(f"{side} block id {bad} is outside the pool's [0, {limit})")
        if len(set(ids)) != len(ids):
            seen: set[int] = set()
            twice = {x for x in ids if x in seen or seen.add(x)}
            raise BlockIdError(f"{side} block id {min(twice)} appears more than once")


def _distinct(arr: np.ndarray) -> bool:
    """No id twice. A set for the short lists most requests carry (numpy's sort costs more there)."""
    if arr.size <= 256:
        return len(set(arr.tolist())) == arr.size
    return np.unique(arr).size == arr.size


def block_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split parallel id lists into runs that are consecutive on both sides.

    Returns ``(src_start, dst_start, num_blocks)`` per run, in request order.
    """
    if src.size == 0:
        return src, dst, np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths


def coalesce(src_offsets: np.ndarray, dst_offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive rows whose byte ranges touch on both sides."""
    if lengths.size <= 1:
        return src_offsets, dst_offsets, lengths
    touches = (src_offsets[1:] == src_offsets[:-1] + lengths[:-1]) & (dst_offsets[1:] == dst_offsets[:-1] + lengths[:-1])
    starts = np.concatenate(([0], np.flatnonzero(~touches) + 1))
    return src_offsets[starts], dst_offsets[starts], np.add.reduceat(lengths, starts)


def plan_block_copies(src: BufferGeometry, dst: BufferGeometry, src_ids: IdList, dst_ids: IdList) -> CopyPlan:
    """Whole-slice copies of ``src_ids`` (in ``src``) into ``dst_ids`` (in ``dst``).

    Both geometries must have the same slice size and outer count (see
    ``check_peer_compatible``). Rows are ordered outer-major, so a run that spans
    whole pools merges across outer slices too.
    """
    s, d = validate_block_ids(src_ids, dst_ids, src.num_blocks, dst.num_blocks)
    return plan_checked_block_copies(src, dst, s, d)


def plan_checked_block_copies(src: BufferGeometry, dst: BufferGeometry, s: np.ndarray, d: np.ndarray) -> CopyPlan:
    """``plan_block_copies`` for ids ``validate_block_ids`` already returned (the request planner's path)."""
    if src.bytes_per_slice != dst.bytes_per_slice or src.num_outer != dst.num_outer:
        raise PeerMetadataError(
            f"source slices are {src.num_outer} x {src.bytes_per_slice} B, destination {dst.num_outer} x "
            f"{dst.bytes_per_slice} B; whole-block copies need the same shape (or a reshard layout)"
        )
    if s.size <= SMALL_IDS:
        plan = _small_block_copies(src, dst, s.tolist(), d.tolist())
        if plan is not None:
            return plan
    run_src, run_dst, run_len = block_runs(s, d)
    outer = np.arange(src.num_outer, dtype=np.int64)[:, None]
    bps = src.bytes_per_slice
    src_off = (outer * src.outer_stride_bytes + run_src * bps).ravel()
    dst_off = (outer * dst.outer_stride_bytes + run_dst * bps).ravel()
    lengths = np.broadcast_to(run_len * bps, (src.num_outer, run_len.size)).ravel()
    src_off, dst_off, lengths = coalesce(src_off, dst_off, lengths)
    plan = CopyPlan(src_off, dst_off, lengths, raw_descriptors=int(s.size) * src.num_outer)
    check_plan_bounds(plan, src, dst)
    return plan


def _small_block_copies(src: BufferGeometry, dst: BufferGeometry, s: Sequence[int], d: Sequence[int],
                        max_rows: int = SMALL_ROWS, check_bounds: bool = True) -> CopyPlan | None:
    """``plan_checked_block_copies`` in plain Python for a short request (None: more than ``max_rows``).

    Rows outer-major, runs consecutive on both sides, touching rows merged, every row inside both
    regions: the numpy path's plan, row for row. ``check_bounds=False`` only where every block of
    both pools was proven inside its region once (``kvxfer.plan.prepared``).
    """
    rows = small_block_rows(src, dst, s, d, max_rows, check_bounds)
    return None if rows is None else CopyPlan.from_rows(rows, len(s) * src.num_outer)


def _runs(s: Sequence[int], d: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src block, dst block, blocks)`` per run of ids consecutive on both sides, in order. Ids in one
    run share ``id - position`` on both sides, so ``groupby`` finds the runs in C (a request's ids are
    walked on the engine's step)."""
    runs = []
    position = 0
    for (src_key, dst_key), run in groupby(zip(map(sub, s, count()), map(sub, d, count()))):
        length = len(list(run))
        runs.append((src_key + position, dst_key + position, length))
        position += length
    return runs


def small_block_rows(src: BufferGeometry, dst: BufferGeometry, s: Sequence[int], d: Sequence[int],
                     max_rows: int = SMALL_ROWS, check_bounds: bool = True
                     ) -> "tuple[list[int], list[int], list[int]] | None":
    """``_small_block_copies``'s rows as three lists of Python ints (source offsets, destination
    offsets, lengths), for a transport that posts them without numpy; None past ``max_rows``."""
    runs = _runs(s, d)
    if src.num_outer * len(runs) > max_rows:
        return None
    bps = src.bytes_per_slice
    src_off: list[int] = []
    dst_off: list[int] = []
    lengths: list[int] = []
    for outer in range(src.num_outer):
        src_base, dst_base = outer * src.outer_stride_bytes, outer * dst.outer_stride_bytes
        for run_src, run_dst, blocks in runs:
            so, do, n = src_base + run_src * bps, dst_base + run_dst * bps, blocks * bps
            if lengths and so == src_off[-1] + lengths[-1] and do == dst_off[-1] + lengths[-1]:
                lengths[-1] += n
            else:
                src_off.append(so)
                dst_off.append(do)
                lengths.append(n)
    if lengths and min(lengths) <= 0:
        raise PeerMetadataError("a planned copy has a non-positive length")
    for offsets, geometry, side in ((src_off, src, "source"), (dst_off, dst, "destination")) if check_bounds else ():
        if any(o < 0 or o + n > geometry.region_bytes for o, n in zip(offsets, lengths)):
            raise PeerMetadataError(
                f"a planned copy leaves the {side} region of {geometry.region_bytes} bytes; the peer meta is inconsistent"
            )
    return src_off, dst_off, lengths


def check_plan_bounds(plan: CopyPlan, src: BufferGeometry, dst: BufferGeometry) -> None:
    """The one place that guarantees no row leaves either exported region."""
    if plan.num_descriptors == 0:
        return
    if (plan.lengths <= 0).any():
        raise PeerMetadataError("a planned copy has a non-positive length")
    for offsets, geometry, side in ((plan.src_offsets, src, "source"), (plan.dst_offsets, dst, "destination")):
        if (offsets < 0).any() or (offsets + plan.lengths > geometry.region_bytes).any():
            raise PeerMetadataError(
                f"a planned copy leaves the {side} region of {geometry.region_bytes} bytes; the peer meta is inconsistent"
            )
