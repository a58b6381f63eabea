"""One request, planned in one pass: the entry point ``begin_pull_blocks`` calls.

A decode rank is handed a per-request meta in whatever shape its engine builds
(Megatron's flat / ``tp_metas`` / ``pp_metas`` with per-record ``block_ids``, or one
peer's ``export_meta()``), its own block ids, and nothing else. ``plan_request``:

1. unwraps the meta into source records (``kvxfer.meta.records``);
2. parses each record once, through the caller's ``parse`` (the backend: seal or
   signature check, then the geometry and transport fields);
3. checks every record's block ids against both pools;
3. chooses which records to read (one per layer window x head range, replicas
   dropped) and, for a wrapped meta, checks they cover all this rank needs;
4. plans each chosen record: whole-slice copies, a TP/PP/SSM reshard, or a staged
   reshard (whole slices into a staging region, heads placed locally), every plan
   bounds-checked against both sides.

Everything raises before anything is posted, and nothing here does I/O: the result is a
``RequestPlan`` of frozen records that a transport posts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from kvxfer.errors import LayoutError, PeerMetadataError
from kvxfer.plan.descriptors import (
    CopyPlan, IdList, check_plan_bounds, plan_block_copies, plan_checked_block_copies, validate_block_ids,
)
from kvxfer.plan.geometry import PeerGeometry, check_peer_compatible, staging_geometry
from kvxfer.plan.pool import LocalPool
from kvxfer.plan.reshard import check_covers, check_same_model, intersect
from kvxfer.plan.reshard_descriptors import plan_reshard_pull, reshard_transfers_for_pull
from kvxfer.plan.staged_reshard import StagedChunk, plan_staged_kv, staging_pays


@dataclass(frozen=True)
class RecordPlan:
    """What to read from one source record: direct ``copy`` rows, or ``staged`` chunks."""

    meta: Mapping[str, Any]  # the record as the engine sent it (the transport reads its own fields)
    peer: PeerGeometry
    src_ids: np.ndarray
    dst_ids: np.ndarray
    copy: CopyPlan  # the direct reads; for a staged record, its first chunk's reads (unused)
    staged: tuple[StagedChunk, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(c.read.total_bytes for c in self.staged) if self.staged else self.copy.total_bytes

    @property
    def num_descriptors(self) -> int:
        return sum(c.read.num_descriptors for c in self.staged) if self.staged else self.copy.num_descriptors


@dataclass(frozen=True)
class RequestPlan:
    """One entry per source record, in the meta's order; None where there is nothing to read."""

    records: tuple[Optional[RecordPlan], ...]

    @property
    def to_read(self) -> list[RecordPlan]:
        return [r for r in self.records if r is not None]

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.to_read)

    @property
    def num_descriptors(self) -> int:
        return sum(r.num_descriptors for r in self.to_read)


@dataclass(frozen=True)
class SourceRecord:
    """One source of a request, parsed: the record as the engine sent it (the transport reads its own
    fields from it), its checked geometry, and the source block ids to read from it."""

    meta: Mapping[str, Any]
    peer: PeerGeometry
    src_ids: IdList


def plan_request(sources: Sequence[SourceRecord], dst_block_ids: IdList, local: LocalPool, *, whole: bool,
                 staging_chunk_bytes: int = 0) -> RequestPlan:
    """The whole request's plan (see the module docstring); raises before anything is posted.

    ``whole``: the engine's meta named every source of the request (a ``tp_metas``/``pp_metas``
    wrapper), so they must cover all this rank needs. ``staging_chunk_bytes`` is the chunk size a
    staged reshard may use, 0 where the transport cannot stage now.
    """
    if not sources:
        raise PeerMetadataError("peer meta names no source (empty tp_metas/pp_metas)")
    records = [(s.meta, s.src_ids) for s in sources]
    peers = [s.peer for s in sources]
    ids = [validate_block_ids(src, dst_block_ids, peer.geometry.num_blocks, local.geometry.num_blocks)
           for (_, src), peer in zip(records, peers)]
    # A wrapped meta (or several records) is the whole request, as in Megatron; a bare
    # meta is one peer, which reads what it holds of ours (nothing, possibly).
    chosen = sources_to_read(local, peers, complete=whole or len(records) > 1)
    planned: list[Optional[RecordPlan]] = []
    for i, ((meta, _), peer, (src_ids, dst_ids)) in enumerate(zip(records, peers, ids)):
        if i not in chosen:
            planned.append(None)
            continue
        staged = plan_staged(local, peer, src_ids, dst_ids, staging_chunk_bytes)
        if staged:
            planned.append(RecordPlan(meta, peer, src_ids, dst_ids, staged[0].read, tuple(staged)))
            continue
        copy = plan_pull(local, peer, src_ids, dst_ids)
        planned.append(None if copy.num_descriptors == 0 else RecordPlan(meta, peer, src_ids, dst_ids, copy))
    return RequestPlan(tuple(planned))


def plan_pull(local: LocalPool, peer: PeerGeometry, src_ids: IdList, dst_ids: IdList) -> CopyPlan:
    """Direct, bounds-checked byte rows from ``peer`` into ``local``.

    With shard layouts on both sides (KV ``layout``, or SSM ``ssm_layout``) only the
    layer x head slices this rank owns are read (``kvxfer.plan.reshard``); otherwise
    whole slices, after checking the two pools hold the same slices.
    """
    reshard = plan_reshard_pull(local, peer, src_ids, dst_ids)
    if reshard is not None:
        return reshard
    check_peer_compatible(local.geometry, local.torch_dtype, peer)
    if isinstance(src_ids, np.ndarray) and isinstance(dst_ids, np.ndarray) and src_ids.dtype == dst_ids.dtype == np.int64:
        return plan_checked_block_copies(peer.geometry, local.geometry, src_ids, dst_ids)  # checked by plan_request
    return plan_block_copies(peer.geometry, local.geometry, src_ids, dst_ids)


def plan_staged(local: LocalPool, peer: PeerGeometry, src_ids: np.ndarray, dst_ids: np.ndarray,
                chunk_bytes: int) -> list[StagedChunk]:
    """A staged KV reshard's chunks, when staging is offered and per-token fragments would be small."""
    if chunk_bytes <= 0 or local.ssm_state_kind is not None or src_ids.size == 0:
        return []
    transfers = reshard_transfers_for_pull(local, peer)
    if not transfers or not staging_pays(transfers, peer.geometry, local.geometry):
        return []
    chunks = plan_staged_kv(peer.geometry, local.geometry, transfers, src_ids, dst_ids, chunk_bytes)
    for chunk in chunks:
        check_plan_bounds(chunk.read, peer.geometry, staging_geometry(chunk.staging_bytes))
    return chunks


def sources_to_read(local: LocalPool, peers: Sequence[PeerGeometry], complete: bool) -> set[int]:
    """Indices of the records to read: with layouts, one per (layer window, head range), the
    lowest global rank. ``complete``: the records claim to be every source of the request,
    so they must hold all this rank needs."""
    if local.ssm_state_kind is not None:
        own: Any = local.ssm_layout
        layouts: list[Any] = [p.ssm_layout for p in peers]
    else:
        own, layouts = local.geometry.layout, [p.geometry.layout for p in peers]
    if own is None or any(x is None for x in layouts):
        if len(peers) > 1:
            raise LayoutError("pulling from several sources needs a shard layout on this pool and on every source")
        return {0}
    check_same_model([own], layouts)
    best: dict[tuple, int] = {}
    for i in sorted(range(len(layouts)), key=lambda i: layouts[i].global_rank):
        best.setdefault((layouts[i].local_layer_range(), layouts[i].local_head_range()), i)
    chosen = sorted(best.values())
    for pos, a in enumerate(chosen):
        for b in chosen[pos + 1:]:
            la, lb = layouts[a], layouts[b]
            if intersect(la.local_layer_range(), lb.local_layer_range()) and intersect(la.local_head_range(), lb.local_head_range()):
                raise LayoutError(
                    f"sources of global rank {la.global_rank} and {lb.global_rank} hold overlapping but different "
                    "slices; pass the ranks of one prefill instance"
                )
    if complete:
        check_covers(own, [layouts[i] for i in chosen])
    return set(chosen)
