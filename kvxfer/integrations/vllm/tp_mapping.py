"""Different tensor parallelism between a prefill and a decode: which prefill ranks each decode rank reads.

vLLM 0.32's NixlConnector decides this in ``nixl/tp_mapping.py`` (``compute_tp_mapping``) and
``kv_connector/utils.py`` (``TransferTopology``); the facts used here, read from there:

* a rank of an instance with TP ``T`` and ``K`` KV heads holds heads
  ``[r*K/T, (r+1)*K/T)`` when ``T <= K``, else the one head ``r*K//T`` (replicated on
  ``T/K`` consecutive ranks);
* decode TP ``D`` >= prefill TP ``P``: decode rank ``d`` reads from prefill rank ``d*P//D``
  only (part of its heads when ``D > P``), and each prefill rank has ``D/P`` readers;
* ``D < P``: decode rank ``d`` reads from ranks ``d*(P/D) + i``, keeping only the first rank
  per distinct head ("GQA dedup": with ``P > K`` several of them hold the same head);
* refused: TP sizes that do not divide one another, and ``D < P`` with the prefill's KV
  replicated (``P > K``) for attention-only models (``_validate_remote_agent_handshake``);
* MLA (``TransferTopology.is_mla``): the latent cache has no heads axis and is the same on
  every rank ("replicated", ``replicates_kv_cache``), so decode rank ``d`` reads whole blocks
  from the one prefill rank ``d*P//D`` in both directions (``compute_tp_mapping``'s ``is_mla``
  branch), tells the other handshake targets it is done (``pull_worker.py``, the
  ``send_notif`` after a single MLA read), and each prefill rank waits for ``max(1, D/P)``
  readers as for attention; the latent block sizes must be equal ("KV cache sizes must match
  between P and D when replicated", ``base_worker.py``).

The head arithmetic itself is kvxfer's reshard planner (``KVShardLayout``,
``kv_transfer_between``), so a vLLM pair is planned the way a Megatron pair is. The byte runs
inside a block, which depend on vLLM's per-layer layout, are ``head_runs``' job. Pure: no
vLLM import, no tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvxfer.errors import LayoutError
from kvxfer.plan.layout import KVShardLayout
from kvxfer.plan.reshard import kv_transfer_between

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadRead:
    """Heads ``[src_head, src_head + num_heads)`` of prefill rank ``src_rank``'s pool land in
    heads ``[dst_head, dst_head + num_heads)`` of the decode rank's pool (rank-local indices)."""

    src_rank: int
    src_head: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class RankReadPlan:
    """What one decode rank does for one request: ``reads`` fill every one of its heads exactly
    once; ``notify`` are the prefill ranks that must hear "done" from it (a rank dropped by the
    GQA dedup is still told, so that it frees the request's blocks)."""

    dst_rank: int
    reads: tuple[HeadRead, ...]
    notify: tuple[int, ...]


def _layout(num_layers: int, total_kv_heads: int, tp_size: int, tp_rank: int) -> KVShardLayout:
    return KVShardLayout(num_layers=num_layers, num_heads=total_kv_heads, tp_size=tp_size, tp_rank=tp_rank,
                         global_rank=tp_rank)


def target_ranks(dst_rank: int, dst_tp: int, src_tp: int) -> tuple[int, ...]:
    """The prefill ranks decode rank ``dst_rank`` handshakes with and must notify (vLLM's
    ``handshake_target_ranks`` without DCP)."""
    if dst_tp >= src_tp:
        return (dst_rank // (dst_tp // src_tp),)
    ratio = src_tp // dst_tp
    return tuple(dst_rank * ratio + i for i in range(ratio))


def source_ranks(dst_rank: int, dst_tp: int, src_tp: int, total_kv_heads: int) -> tuple[int, ...]:
    """The prefill ranks decode rank ``dst_rank`` reads from, in vLLM's order, deduplicated by head."""
    targets = target_ranks(dst_rank, dst_tp, src_tp)
    if dst_tp >= src_tp:
        return targets
    seen, out = set(), []
    for rank in targets:
        head = rank * total_kv_heads // src_tp
        if head not in seen:
            seen.add(head)
            out.append(rank)
    return tuple(out)


def readers_per_source(dst_tp: int, src_tp: int) -> int:
    """How many decode ranks notify each prefill rank for one request; a prefill rank frees the
    request's blocks after that many (vLLM's ``dcp_consumer_count`` without DCP)."""
    return max(1, dst_tp // src_tp)


def describe_side(role: str, tp_size: int, total_kv_heads: int, layout_name: str, block_size: int) -> str:
    per_rank = max(1, total_kv_heads // tp_size) if tp_size > 0 else "?"
    replicated = f", each head on {tp_size // total_kv_heads} ranks" if 0 < total_kv_heads < tp_size else ""
    return (f"{role} TP {tp_size} ({total_kv_heads} KV heads, {per_rank} per rank{replicated}), "
            f"layout {layout_name}, block_size {block_size}")


def check_tp_pair(*, src_tp: int, dst_tp: int, total_kv_heads: int, src_layout: str, dst_layout: str,
                  src_block_size: int, dst_block_size: int) -> None:
    """Refuse what NixlConnector refuses (and what kvxfer cannot read byte-exact), naming both sides.

    ``*_layout`` are vLLM's layout names (``LBHNC`` = HND, ``LBNHC`` = NHD, or a legacy shape);
    NixlConnector's optional LBHNC->LBNHC permute after the read is not done here. Block sizes are named
    only; whether they pair is ``block_sizes``' rule.
    """
    sides = (f"prefill {describe_side('prefill', src_tp, total_kv_heads, src_layout, src_block_size)}; "
             f"decode {describe_side('decode', dst_tp, total_kv_heads, dst_layout, dst_block_size)}")
    if min(src_tp, dst_tp, total_kv_heads) < 1:
        raise LayoutError(f"TP sizes and KV heads must be positive: {sides}")
    if max(src_tp, dst_tp) % min(src_tp, dst_tp):
        raise LayoutError(f"TP sizes {src_tp} and {dst_tp} do not divide one another: {sides}")
    for tp in (src_tp, dst_tp):
        if (tp <= total_kv_heads and total_kv_heads % tp) or (tp > total_kv_heads and tp % total_kv_heads):
            raise LayoutError(f"TP {tp} does not split or replicate {total_kv_heads} KV heads evenly: {sides}")
    if dst_tp < src_tp and src_tp > total_kv_heads:
        raise LayoutError(f"a decode with fewer ranks than a prefill that replicates its KV heads is refused, "
                          f"as by NixlConnector: {sides}")
    if src_layout != dst_layout:
        raise LayoutError(f"different KV cache layouts ({src_layout} vs {dst_layout}); heads cannot be read in "
                          f"place: {sides}")


def mla_source_rank(dst_rank: int, dst_tp: int, src_tp: int) -> int:
    """MLA: the one prefill rank decode rank ``dst_rank`` reads its whole latent blocks from. Any
    rank would do (each holds the same latent cache); vLLM's ``d*P//D`` spreads the decode ranks
    over the prefill's when ``P > D`` and keeps ``D/P`` readers per prefill rank when ``D > P``."""
    return dst_rank * src_tp // dst_tp


def check_mla_pair(*, src_tp: int, dst_tp: int, src_latent: str, dst_latent: str, src_block_size: int,
                   dst_block_size: int) -> None:
    """Refuse an MLA pair NixlConnector refuses, naming both sides: TP sizes that do not divide one
    another, different latent blocks (``*_latent`` describe one layer's block on each side; block sizes are
    ``block_sizes``' rule)."""
    sides = f"prefill TP {src_tp}, {src_latent}; decode TP {dst_tp}, {dst_latent}"
    if min(src_tp, dst_tp) < 1 or max(src_tp, dst_tp) % min(src_tp, dst_tp):
        raise LayoutError(f"MLA: TP sizes {src_tp} and {dst_tp} do not divide one another: {sides}")
    if src_latent != dst_latent:
        raise LayoutError(f"MLA: different latent cache per block, a replicated cache is read whole: {sides}")


def plan_rank_reads(*, dst_rank: int, dst_tp: int, src_tp: int, total_kv_heads: int,
                    num_layers: int = 1) -> RankReadPlan:
    """Decode rank ``dst_rank``'s reads: the kvxfer reshard planner's rectangle with each source
    vLLM would read from; raises ``LayoutError`` unless they cover its heads exactly once."""
    dst = _layout(num_layers, total_kv_heads, dst_tp, dst_rank)
    reads = []
    for rank in source_ranks(dst_rank, dst_tp, src_tp, total_kv_heads):
        transfer = kv_transfer_between(_layout(num_layers, total_kv_heads, src_tp, rank), dst)
        if transfer is not None:
            reads.append(HeadRead(src_rank=rank, src_head=transfer.src_head_offset,
                                  dst_head=transfer.dst_head_offset, num_heads=transfer.num_heads))
    # every head exactly once, checked per read (a peer's head count is only bounded, never enumerated)
    ranges = sorted((r.dst_head, r.dst_head + r.num_heads) for r in reads)
    tiles = bool(ranges) and ranges[0][0] == 0 and ranges[-1][1] == dst.heads_per_partition and all(
        a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(lo < hi for lo, hi in ranges)
    if not tiles:
        raise LayoutError(f"decode rank {dst_rank} (TP {dst_tp}) would get heads {ranges[:8]} (as ranges) of "
                          f"{dst.heads_per_partition} from prefill TP {src_tp} with {total_kv_heads} KV heads")
    plan = RankReadPlan(dst_rank=dst_rank, reads=tuple(reads), notify=target_ranks(dst_rank, dst_tp, src_tp))
    log.debug("TP %d -> %d, rank %d: %s", src_tp, dst_tp, dst_rank, plan)
    return plan
