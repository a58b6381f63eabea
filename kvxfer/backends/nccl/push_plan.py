"""The prefill side's half of a push: the plan each decode rank will receive, computed here.

A two-sided transfer only works if sender and receiver cut the same bytes in the
same order. The decode rank plans its receive with ``kvxfer.plan.request.plan_pull``
(local = decode pool, peer = this prefill pool). The prefill runs *that same
function* on the decode pool as its validated meta describes it (``LocalPool.from_peer``),
so both sides run one planner rather than two that could drift apart.

The decode's block ids are not needed: a plan's rows follow (piece, outer index,
block in request order, fragment), and splitting the blocks into runs that are
consecutive on both sides only groups rows, it never reorders bytes. Message
content is therefore a function of the source ids alone; any valid destination
ids give the same stream (``tests/backends/test_nccl_backend.py`` checks it).

Which prefill rank sends, when several hold the same slice (``tp_size`` larger
than the KV heads replicates each head on consecutive TP ranks): the decode reads
the lowest global rank of each replica group; the prefill rank sends only if it is
the first TP rank of its group. These agree when global ranks grow with the TP
rank inside a stage (Megatron's rank order); the decode checks it before posting.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kvxfer.backends.base import KVTransportBackend
from kvxfer.errors import BlockIdError, LayoutError
from kvxfer.plan.descriptors import CopyPlan
from kvxfer.plan.geometry import PeerGeometry
from kvxfer.plan.pool import LocalPool
from kvxfer.plan.request import plan_pull
from kvxfer.plan.layout import KVShardLayout


def own_peer_geometry(backend: KVTransportBackend) -> PeerGeometry:
    """This pool as its peer sees it after parsing our meta."""
    return PeerGeometry(backend.geometry, backend.dtype_name, backend.ssm_layout, backend.ssm_state_kind)


def sends_for_replicas(layout: Optional[KVShardLayout]) -> bool:
    """Whether this KV rank is the one of its head-replica group that sends (see the module docstring)."""
    return layout is None or layout.tp_rank % layout.head_replicas == 0


def check_replica_source(layout: Optional[KVShardLayout]) -> None:
    """Decode side: refuse to wait on a replica that, by the push rule, will never send."""
    if not sends_for_replicas(layout):
        assert layout is not None
        first = layout.tp_rank - layout.tp_rank % layout.head_replicas
        raise LayoutError(
            f"this decode rank would receive heads {layout.local_head_range()} from prefill global rank "
            f"{layout.global_rank} (tp_rank {layout.tp_rank}), but with {layout.head_replicas} replicas per head "
            f"only tp_rank {first} of that group pushes. Pass the metas of every prefill TP rank, with global "
            "ranks that grow with the TP rank inside a stage"
        )


def placeholder_destination(record_ids: Any, num_src: int, decode: PeerGeometry) -> np.ndarray:
    """Destination ids for planning: the record's own ``block_ids`` if it names them, else ``0..n-1``.

    Only the count matters to the message (see the module docstring).
    """
    ids = np.asarray(record_ids, dtype=np.int64).reshape(-1) if len(record_ids) else np.zeros(0, np.int64)
    if ids.size:
        if ids.size != num_src:
            raise BlockIdError(f"the decode record names {ids.size} block ids, the push has {num_src} source blocks")
        return ids
    if num_src > decode.geometry.num_blocks:
        raise BlockIdError(f"pushing {num_src} blocks to a decode pool of {decode.geometry.num_blocks} blocks")
    return np.arange(num_src, dtype=np.int64)


def plan_push(backend: KVTransportBackend, decode: PeerGeometry, src_ids: np.ndarray,
              dst_ids: np.ndarray) -> Optional[CopyPlan]:
    """The plan the decode rank ``decode`` will receive from ``backend``; None when it receives nothing."""
    resharded = backend.geometry.layout is not None and decode.geometry.layout is not None
    if backend.ssm_state_kind is None and resharded and not sends_for_replicas(backend.geometry.layout):
        return None  # the decode reads this slice from the first replica (only with layouts on both sides)
    plan = plan_pull(LocalPool.from_peer(decode), own_peer_geometry(backend), src_ids, dst_ids)
    return None if plan.num_descriptors == 0 else plan
