"""Pull one request from several prefill ranks into one decode rank.

With different TP/PP on the two sides a decode rank's slices live on several
prefill ranks. ``begin_pull_from_peers`` plans every part first (parse each peer's
meta, check ids, check the peers hold everything this rank needs, drop replica
peers), and only then posts the reads, so a bad part leaves every pool untouched.
The parts are returned as one ``GroupHandle``; a peer holding nothing this rank
needs (or a replica of another peer) gets an already-complete handle.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from kvxfer.backends.base import (
    CompletedHandle, GroupHandle, KVTransportBackend, RequestId, TransferHandle, TransferState,
)
from kvxfer.plan.descriptors import IdList, validate_block_ids
from kvxfer.errors import KVXferError, LayoutError, PeerMetadataError, TransferError
from kvxfer.plan.reshard import check_covers, check_same_model, intersect
from kvxfer.plan.ssm_layout import SSMShardLayout

PeerPart = tuple[Mapping[str, Any], IdList]


def _layouts(backend: KVTransportBackend, peers: Sequence[Any]) -> tuple[Any, list[Any]]:
    if backend.ssm_state_kind is not None:
        own = backend.ssm_layout if isinstance(backend.ssm_layout, SSMShardLayout) else None
        return own, [p.ssm_layout for p in peers]
    return backend.geometry.layout, [p.geometry.layout for p in peers]


def _chosen_parts(own: Any, layouts: Sequence[Any]) -> set[int]:
    """Indices of the peers to read: one per (layer window, head range), lowest global rank,
    after checking they are disjoint and cover everything ``own`` needs."""
    best: dict[tuple, int] = {}
    for i in sorted(range(len(layouts)), key=lambda i: layouts[i].global_rank):
        best.setdefault((layouts[i].local_layer_range(), layouts[i].local_head_range()), i)
    chosen = sorted(best.values())
    for a_pos, a in enumerate(chosen):
        for b in chosen[a_pos + 1:]:
            la, lb = layouts[a], layouts[b]
            if intersect(la.local_layer_range(), lb.local_layer_range()) and intersect(la.local_head_range(), lb.local_head_range()):
                raise LayoutError(
                    f"peers of global rank {la.global_rank} and {lb.global_rank} hold overlapping but different "
                    "slices; pass the ranks of one prefill instance"
                )
    check_covers(own, [layouts[i] for i in chosen])
    return set(chosen)


def begin_pull_from_peers(
    backend: KVTransportBackend,
    parts: Sequence[PeerPart],
    dst_block_ids: IdList,
    *,
    request_id: Optional[RequestId] = None,
) -> TransferHandle:
    """Read ``dst_block_ids`` of this rank from every ``(peer_meta, src_block_ids)`` part.

    Every source is told "read done" under the same ``request_id``. Raises
    (``LayoutError``, ``PeerMetadataError``, ``BlockIdError``) before posting
    anything if a part is invalid or the parts do not hold all this rank needs.
    """
    if not parts:
        raise LayoutError("begin_pull_from_peers needs at least one (peer_meta, src_block_ids) part")
    backend._check_open()
    peers = [backend.parse_peer_meta(meta) for meta, _ in parts]
    own, layouts = _layouts(backend, peers)
    if own is None or any(x is None for x in layouts):
        if len(parts) > 1:
            raise LayoutError("pulling from several peers needs a shard layout on this pool and on every peer")
        chosen = {0}
    else:
        check_same_model([own], layouts)
        chosen = _chosen_parts(own, layouts)
    if request_id is None:
        request_id = f"{backend.agent_name}:{next(backend._request_counter)}"
    elif not isinstance(request_id, (int, str)) or isinstance(request_id, bool):
        raise PeerMetadataError(f"request_id must be an int or a str, got {request_id!r}")

    # Plan every part before posting any: a bad part raises with every pool untouched.
    posts: list[bool] = []
    for i, ((meta, src_ids), peer) in enumerate(zip(parts, peers)):
        s, d = validate_block_ids(src_ids, dst_block_ids, peer.geometry.num_blocks, backend.geometry.num_blocks)
        plan = backend.plan_pull(peer, s, d) if i in chosen else None
        posts.append(plan is not None and not (plan.num_descriptors == 0 and s.size))

    handles: list[TransferHandle] = []
    try:
        for (meta, src_ids), post in zip(parts, posts):
            handles.append(backend.begin_pull_blocks(meta, src_ids, dst_block_ids, request_id=request_id)
                           if post else CompletedHandle(request_id))
    except KVXferError as exc:
        for handle in handles:  # stop what was already posted; the group failed as a whole
            with handle._lock:
                if handle.state is TransferState.PROC:
                    handle._fail(TransferError(f"request {request_id!r}: aborted, another part failed to post: {exc}"))
        raise
    return GroupHandle(request_id, handles, backend.timeout_s)
