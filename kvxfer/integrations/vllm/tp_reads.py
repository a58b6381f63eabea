"""What one decode rank posts for one request: slab reads per prefill rank, and whom it tells "done".

Equal TP reads every slab of each block from the same rank (the whole block, as always).
Different TP is NixlConnector's mapping (``tp_mapping.plan_rank_reads``) turned into reads of
*head slabs*: on ``LBHNC`` each region is registered one slab per head (``kv_buffers``), so
heads ``h0..h0+n-1`` of block ``b`` on a side with ``H`` heads per rank are backend ids
``b*H+h0 .. b*H+h0+n-1``, and the existing whole-"block" reads fetch exactly a rank's heads,
byte-exact, with each side using its own ``H``. On ``LBNHC`` (NHD) a head's bytes are not contiguous
in a block: a decode rank reads its head range as one run per token (``PartRead``, ``block_parts``); the
handshake refuses different TP on other layouts (``handshake.tp_problem``). A prefill block smaller than
the decode's (``block_sizes``) is read as parts too: each prefill slab into its sub-block of a decode slab.
MLA has no heads to split: every rank holds the same latent cache, so a decode rank reads its
whole blocks from one prefill rank (``tp_mapping.mla_source_rank``) and still tells every
prefill rank it maps to that it is done, as NixlConnector does. A hybrid attention+Mamba2 model's
pages hold a different share of each state on each TP size: its reads are ``hybrid_tp.PageRead``s,
the parts of each group's pages a decode rank needs from each prefill rank. A prefill of PP > 1 (at equal
TP) is read stage by stage (``pp_stages.StageRead``): each stage's regions from that stage's rank, each
stage told "done" on its own lease.

A prefill rank frees a request only once *every* decode rank that reads it is done. That count
is the decode's to know (it depends on the decode's TP), so it travels in the read-done: each
reader labels its reads ``reader_label(request_id, i, n)`` (reader ``i`` of ``n``), and the
producer's ``Sender`` frees after ``n`` distinct readers reported (or ``pin_grace_s``). With
one reader per prefill rank the label is the bare request id, as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from kvxfer.integrations.vllm.attn_format import CPU_VEC, TOKENS
from kvxfer.integrations.vllm.block_parts import Parts, cpu_vec_parts, itemsize, nhd_head_parts, sub_block_parts
from kvxfer.integrations.vllm.block_sizes import block_ratio
from kvxfer.integrations.vllm.handshake import layout_name
from kvxfer.integrations.vllm.hybrid_tp import PageRead, page_reads
from kvxfer.integrations.vllm.kv_buffers import slabs_per_block
from kvxfer.integrations.vllm.pp_stages import StageRead, stage_targets
from kvxfer.integrations.vllm.tp_mapping import mla_source_rank, plan_rank_reads, readers_per_source, target_ranks

_LABEL = re.compile(r"^(?P<id>.+)#kvxfer-reader-(?P<i>\d{1,4})-of-(?P<n>\d{1,4})$", re.S)
#: The most decode ranks that read one prefill rank (decode TP / prefill TP): a label claiming more is a
#: peer's invention (it would keep the request's blocks pinned until pin_grace_s, and grow its reports).
MAX_READERS = 128


def reader_label(request_id: str, reader: int, readers: int) -> str:
    """The request id a reader posts under; bare when it is a prefill rank's only reader."""
    return request_id if readers <= 1 else f"{request_id}#kvxfer-reader-{reader}-of-{readers}"


def parse_reader_label(label: str) -> tuple[str, int, int]:
    """``(request_id, reader, readers)`` of a label (``(label, 0, 1)`` for a bare id)."""
    m = _LABEL.match(label)
    if m is None or not 0 <= int(m["i"]) < int(m["n"]) <= MAX_READERS:
        return label, 0, 1
    return m["id"], int(m["i"]), int(m["n"])


@dataclass(frozen=True)
class SlabRead:
    """Slabs ``src_first..+count`` of each block at prefill rank ``src_rank`` (``src_slabs`` per block)
    into slabs ``dst_first..`` of the decode's blocks (``dst_slabs`` per block)."""

    src_rank: int
    src_first: int
    dst_first: int
    count: int
    src_slabs: int
    dst_slabs: int

    def ids(self, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Backend ids for vLLM blocks ``src_blocks`` -> ``dst_blocks``, in the same order."""
        if len(src_blocks) <= 1024:  # a request's handful of blocks: plain Python beats numpy's per-call cost
            span = range(self.count)
            return ([b * self.src_slabs + self.src_first + i for b in src_blocks for i in span],
                    [b * self.dst_slabs + self.dst_first + i for b in dst_blocks for i in span])
        span = np.arange(self.count, dtype=np.int64)
        src = (np.asarray(src_blocks, dtype=np.int64)[:, None] * self.src_slabs + self.src_first + span).ravel()
        dst = (np.asarray(dst_blocks, dtype=np.int64)[:, None] * self.dst_slabs + self.dst_first + span).ravel()
        return src.tolist(), dst.tolist()


@dataclass(frozen=True)
class PartRead:
    """The slabs ``slabs`` names, but only byte ranges of each (``block_parts``): ``parts[j]`` for a prefill
    block that is sub-block ``j`` of its decode block (one entry with equal block sizes)."""

    slabs: SlabRead
    parts: tuple[Parts, ...]

    @property
    def src_rank(self) -> int:
        return self.slabs.src_rank


@dataclass(frozen=True)
class Notify:
    """Prefill rank ``rank`` hears "done" from this decode rank as reader ``reader`` of ``readers``."""

    rank: int
    reader: int
    readers: int


@dataclass(frozen=True)
class RankReads:
    reads: "tuple[SlabRead | PartRead | PageRead | StageRead, ...]"
    notify: tuple[Notify, ...]
    ratio: int = 1  # prefill blocks per decode block (``block_sizes``)


def _slabs(regions: Sequence[Mapping]) -> int:
    counts = {slabs_per_block(str(r.get("layout")), list(r.get("layer_shape") or [None, None])) for r in regions}
    return counts.pop() if len(counts) == 1 else 1


def notify_ranks(tp_rank: int, dst_tp: int, src_tp: int) -> tuple[Notify, ...]:
    """Whom decode rank ``tp_rank`` tells "done" (also when it refuses the request: the prefill
    frees at once); its own rank when the TP sizes do not map."""
    if src_tp == dst_tp or max(src_tp, dst_tp) % min(src_tp, dst_tp):
        return (Notify(tp_rank, 0, 1),) if tp_rank < src_tp else ()
    readers = readers_per_source(dst_tp, src_tp)
    return tuple(Notify(rank, tp_rank % readers if readers > 1 else 0, readers)
                 for rank in target_ranks(tp_rank, dst_tp, src_tp))


def rank_reads(tp_rank: int, local, remote) -> RankReads:
    """The reads and notifications of decode rank ``tp_rank`` (``local``/``remote``: the decode's and
    the prefill's ``EngineLayout``, already found compatible by ``handshake.check_compatible``)."""
    src_slabs, dst_slabs = _slabs(remote.regions), _slabs(local.regions)
    if remote.stages:  # pipeline stages at equal TP (``pp_stages``): each stage's own rank, each told "done"
        entries = [stage.index * remote.tp_size + tp_rank for stage in remote.stages]
        return RankReads(tuple(StageRead(SlabRead(entry, 0, 0, dst_slabs, src_slabs, dst_slabs), stage.index,
                                         stage_targets(remote, local, stage))
                               for entry, stage in zip(entries, remote.stages)),
                         tuple(Notify(entry, 0, 1) for entry in entries))
    notify = notify_ranks(tp_rank, local.tp_size, remote.tp_size)
    if remote.tp_size != local.tp_size and remote.is_hybrid:  # parts of its pages (``hybrid_tp``)
        return RankReads(page_reads(tp_rank, remote, local), notify)
    ratio = block_ratio(remote, local)
    if remote.tp_size == local.tp_size or remote.is_mla:
        source = mla_source_rank(tp_rank, local.tp_size, remote.tp_size)  # its own rank with equal TP
        reads = [SlabRead(source, 0, 0, dst_slabs, src_slabs, dst_slabs)]
    else:
        plan = plan_rank_reads(dst_rank=tp_rank, dst_tp=local.tp_size, src_tp=remote.tp_size,
                               total_kv_heads=int(local.model["num_kv_heads"]))
        reads = [SlabRead(r.src_rank, r.src_head, r.dst_head, r.num_heads, src_slabs, dst_slabs) for r in plan.reads]
    if layout_name(local) == "LBNHC" and (ratio > 1 or remote.tp_size != local.tp_size) and not remote.is_mla:
        # a head range or a sub-block of an NHD block: whole blocks (one slab each), read by runs
        heads = [(r.src_first, r.dst_first, r.count) if remote.tp_size != local.tp_size
                 else (0, 0, int(local.regions[0]["layer_shape"][1])) for r in reads]
        return RankReads(tuple(PartRead(SlabRead(r.src_rank, 0, 0, 1, 1, 1), nhd_head_parts(
            remote.regions[0], local.regions[0], src_tokens=remote.block_size, dst_tokens=local.block_size,
            src_head=h[0], dst_head=h[1], num_heads=h[2])) for r, h in zip(reads, heads)), notify, ratio)
    if ratio > 1:  # each prefill slab (a head's tokens, or a whole block) into its sub-block of a decode slab
        region = remote.regions[0]
        if local.model.get("kv_format", TOKENS) == CPU_VEC:  # K transposed, then V (``attn_format``)
            parts = cpu_vec_parts(ratio, src_tokens=remote.block_size, head_size=int(region["layer_shape"][-1]) // 2,
                                  item=itemsize(region))
        else:
            slab = remote.block_size * int(region["layer_shape"][-1]) * itemsize(region)
            parts = sub_block_parts(ratio, slab * (int(region["layer_shape"][1]) if src_slabs == 1 else 1))
        return RankReads(tuple(PartRead(r, parts) for r in reads), notify, ratio)
    return RankReads(tuple(reads), notify)
