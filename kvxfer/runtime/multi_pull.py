"""Pull one request from several prefill ranks given as separate ``(meta, src ids)`` parts.

A thin helper over ``KVTransportBackend.begin_pull_blocks``, which does the work for
Megatron's wrapped metas: the parts become one ``{"tp_metas": [...]}`` with each part's
ids as its ``block_ids``. One code path plans, checks coverage, drops replicas and
posts; this only changes the calling shape.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from kvxfer.backends.base import KVTransportBackend, RequestId, TransferHandle
from kvxfer.errors import LayoutError
from kvxfer.plan.descriptors import IdList

PeerPart = tuple[Mapping[str, Any], IdList]


def begin_pull_from_peers(
    backend: KVTransportBackend,
    parts: Sequence[PeerPart],
    dst_block_ids: IdList,
    *,
    request_id: Optional[RequestId] = None,
) -> TransferHandle:
    """Read ``dst_block_ids`` of this rank from every ``(peer_meta, src_block_ids)`` part (see the module)."""
    if not parts:
        raise LayoutError("begin_pull_from_peers needs at least one (peer_meta, src_block_ids) part")
    wrapped = {"tp_metas": [{**meta, "block_ids": list(src_ids)} for meta, src_ids in parts]}
    return backend.begin_pull_blocks(wrapped, [], dst_block_ids, request_id=request_id)
