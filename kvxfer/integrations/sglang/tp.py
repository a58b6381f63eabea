"""Different attention TP or PP between an SGLang prefill and decode: which bytes of each page a decode
rank reads from each prefill rank SGLang pairs it with, into which of its buffers. Pure: no SGLang import,
no I/O.

SGLang decides the pairing (``CommonKVManager._resolve_rank_mapping``, ``CommonKVReceiver``): with decode
TP ``D`` and prefill TP ``P``, decode rank ``d`` registers with prefill rank ``d // (D/P)`` when ``D >= P``
(each prefill rank then expects ``D/P`` decode ranks per room: ``required_dst_info_num``), else with ranks
``d*(P/D) ... (d+1)*(P/D) - 1`` (all real for MHA/GQA; for MLA only the first, the others *dummy*: they
expect one decode per room and hand nothing over). kvxfer keeps that pairing and plans the bytes here.

SGLang's MHA/GQA pool (``MHATokenToKVPool``) is one ``[tokens, heads_on_rank, head_dim]`` tensor per layer
for K and one for V; one *item* of ``KVArgs`` is a page of one of them, ``page_size`` token rows of
``heads_on_rank * head_dim`` elements. So a rank's heads are strided within a page: a decode rank reads, per
token of each page, the head run it shares with the prefill rank (``kvxfer.plan.parts.SlicePart``, one per
token row; kvxfer's planner turns them into descriptors, adjacent ones merged). Which heads a rank holds is
kvxfer's ``KVShardLayout`` (heads split evenly by TP, or each head on ``TP/K`` consecutive ranks when TP
exceeds the ``K`` KV heads); the head size comes from the prefill's item length and its ``kv_head_num``
(SGLang sets it on a non-MLA prefill; the decode's ``KVArgs`` has no head count, so the decode's heads are
its item length over the prefill's head size, checked against ``K``). An MLA pool holds one latent copy per
rank: whole pages, any TP.

Pipeline stages (a prefill of PP ``P`` > 1, a decode of PP 1): SGLang registers the decode rank with every
stage's rank (``target_pp_ranks``, its ``bootstrap_infos``), each stage expecting one decode rank per room.
A stage's KV buffers are its own layers only, ``[prefill_start_layer, + count)`` (``regions.kv_layout``), K
layers then V layers (MHA/GQA) or one latent per layer (MLA); the decode's are every layer. So stage buffer
``i`` goes into decode buffer ``start + i`` (K, MLA) or ``L + start + (i - n)`` (V, ``L`` the decode's layers,
``n`` the stage's): ``PagePlan.buffers``. Whole pages, at the same attention TP only. Each decode layer must
be read from exactly one stage: ``stage_coverage`` checks a room's stages tile the decode's layers.

Mamba state across attention TP sizes (``plan_state``): each state tensor's slot is sliced along its TP-sharded
axis as SGLang's own nixl slices it (``PagePlan.state``, read from every source the decode rank pairs with).

``plan_pair`` answers for one (prefill rank, decode rank) pair: why not (one line naming both layouts), or
what to read. The layouts are ``regions.kv_layout`` dicts, one from each side.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from kvxfer.errors import GeometryError
from kvxfer.plan.layout import KVShardLayout
from kvxfer.plan.parts import SlicePart
from kvxfer.plan.reshard import kv_transfer_between

#: Layout fields that may differ between the two sides when their attention TP differs (checked here);
#: every other field must be equal.
TP_FIELDS = ("attn_tp_size", "attn_tp_rank", "kv_head_num", "total_kv_head_num", "kv_item_lens", "state_item_lens",
             "state_dims", "prefill_end_layer")
#: Layout fields that may differ between a prefill stage and a decode of PP 1 (checked here).
PP_FIELDS = ("pp_size", "pp_rank", "layers", "kv_buffers", "kv_item_lens", "prefill_end_layer", "attn_tp_rank",
             "kv_head_num", "total_kv_head_num")
#: Fields only the prefill states (SGLang sets them there): never compared as such.
PREFILL_ONLY = ("kv_head_num", "total_kv_head_num", "prefill_end_layer")
#: The most decode ranks one prefill rank serves per room (SGLang's ``required_dst_info_num``: decode TP over
#: prefill TP): a bound on what a peer's metadata may claim.
MAX_READERS = 64


@dataclass(frozen=True)
class PagePlan:
    """What one decode rank reads from one prefill rank per page. ``parts``: per KV buffer of the prefill
    (``kv_item_lens`` order), the byte ranges of a page to read, or None for the whole page. ``heads``:
    ``(src_head, dst_head, num_heads)`` in each side's local heads when heads are resliced, else None.
    ``buffers``: per KV buffer of the prefill, the decode's buffer it goes into (a pipeline stage's layers
    are some of the decode's), None for the same buffer; ``layers``: the stage's ``[start, stop)`` then."""

    parts: tuple[Optional[tuple[SlicePart, ...]], ...]
    heads: Optional[tuple[int, int, int]] = None
    buffers: Optional[tuple[int, ...]] = None
    layers: Optional[tuple[int, int]] = None
    state: Optional["StatePlan"] = None  # Mamba state across attention TP sizes; None: whole slots, first source

    @property
    def whole_pages(self) -> bool:
        return all(p is None for p in self.parts)

    def pairs(self) -> list[tuple[int, int]]:
        """``(prefill buffer, decode buffer)`` for every KV buffer this pair reads."""
        targets = self.buffers if self.buffers is not None else range(len(self.parts))
        return list(enumerate(targets))


@dataclass(frozen=True)
class StatePlan:
    """What one decode rank reads of one state slot from one prefill rank across attention TP sizes: per state
    component (``state_types`` order), per tensor (``state_item_lens`` order), the byte blocks of the slot
    (``plan_state``). Every source a decode rank reads the room from gives its blocks (several prefill ranks:
    each its shard)."""

    parts: tuple[tuple[tuple[SlicePart, ...], ...], ...]



def describe(layout: dict[str, Any]) -> str:
    """One side's layout in a line: TP size and rank, its heads (or MLA), page size and item lengths."""
    if not layout:
        return "no layout"
    if layout.get("mla"):
        heads = "MLA (one latent copy per rank)"
    elif layout.get("kv_head_num") is not None:
        heads = f"{layout['kv_head_num']} of {layout.get('total_kv_head_num')} KV heads"
    else:
        heads = "KV heads not stated (SGLang's decode sets none)"
    lens = layout.get("kv_item_lens") or []
    shown = f"{lens[:4]}{'...' if len(lens) > 4 else ''}"
    stage = ""
    if int(layout.get("pp_size") or 1) != 1:
        layers = layout.get("layers")
        stage = (f"pp_size={layout.get('pp_size')} rank {layout.get('pp_rank')} (layers "
                 f"{'not stated' if not layers else f'[{layers[0]}, {layers[1]})'}), ")
    return (f"attn_tp_size={layout.get('attn_tp_size')} rank {layout.get('attn_tp_rank')}, {stage}{heads}, page_size="
            f"{layout.get('page_size')}, {len(lens)} KV buffers of {shown} B per page")


def _field_diffs(prefill: dict[str, Any], decode: dict[str, Any], skip: tuple[str, ...]) -> list[str]:
    return [f"{key}: prefill={prefill.get(key)!r} decode={decode.get(key)!r}"
            for key in sorted(set(prefill) | set(decode)) if key not in skip and prefill.get(key) != decode.get(key)]


def _both(prefill: dict[str, Any], decode: dict[str, Any]) -> str:
    return f"prefill {describe(prefill)}; decode {describe(decode)}"


def plan_pair(prefill: dict[str, Any], decode: dict[str, Any]) -> tuple[Optional[str], Optional[PagePlan]]:
    """``(refusal, None)`` when this decode rank cannot read this prefill rank's pages byte-exact, naming what
    differs (and, for a TP difference, both layouts); else ``(None, plan)``."""
    tp_p, tp_d = int(prefill.get("attn_tp_size") or 0), int(decode.get("attn_tp_size") or 0)
    buffers = len(prefill.get("kv_item_lens") or [])
    if int(prefill.get("pp_size") or 1) != 1 or int(decode.get("pp_size") or 1) != 1:
        return _plan_stage(prefill, decode)
    if tp_p == tp_d:
        diffs = _field_diffs(prefill, decode, ("attn_tp_rank",) + PREFILL_ONLY)
        if not diffs and not prefill.get("mla") and prefill.get("attn_tp_rank") != decode.get("attn_tp_rank"):
            diffs.append(f"attn_tp_rank: prefill={prefill.get('attn_tp_rank')!r} decode={decode.get('attn_tp_rank')!r}"
                         " (the same TP size pairs equal ranks: they hold the same heads)")
        return ("; ".join(diffs), None) if diffs else (None, PagePlan((None,) * buffers))
    diffs = _field_diffs(prefill, decode, TP_FIELDS)
    if diffs:
        return "; ".join(diffs), None
    if min(tp_p, tp_d) < 1 or max(tp_p, tp_d) % min(tp_p, tp_d):
        return f"attention TP sizes {tp_p} and {tp_d} do not divide one another: {_both(prefill, decode)}", None
    state_plan = None
    if prefill.get("state_types") or decode.get("state_types"):
        refused, state_plan = plan_state(prefill, decode)
        if refused:
            return refused, None
    refused, plan = _plan_pages(prefill, decode, buffers)
    return (refused, None) if refused else (None, replace(plan, state=state_plan))


def _plan_pages(prefill: dict[str, Any], decode: dict[str, Any], buffers: int) -> tuple[Optional[str],
                                                                                         Optional[PagePlan]]:
    page = int(prefill["page_size"])
    src_lens, dst_lens = [int(x) for x in prefill["kv_item_lens"]], [int(x) for x in decode["kv_item_lens"]]
    if prefill.get("mla"):  # one latent copy per rank: the same page on every rank of either side
        if src_lens != dst_lens:
            return (f"MLA pages differ in length (kv_item_lens: prefill={src_lens} decode={dst_lens}): "
                    f"{_both(prefill, decode)}"), None
        return None, PagePlan((None,) * buffers)
    return _plan_heads(prefill, decode, page, src_lens, dst_lens)


def _plan_heads(prefill: dict[str, Any], decode: dict[str, Any], page: int, src_lens: list[int],
                dst_lens: list[int]) -> tuple[Optional[str], Optional[PagePlan]]:
    tp_p, tp_d = int(prefill["attn_tp_size"]), int(decode["attn_tp_size"])
    both = _both(prefill, decode)
    if prefill.get("num_draft_entries"):
        return f"kvxfer does not reslice draft-model KV buffers across attention TP sizes: {both}", None
    heads_p, total = prefill.get("kv_head_num"), prefill.get("total_kv_head_num")
    if not heads_p or not total:
        return f"the prefill states no KV head count (SGLang sets it on a non-MLA prefill): {both}", None
    heads_p, total = int(heads_p), int(total)
    try:
        src = KVShardLayout(num_layers=1, num_heads=total, tp_size=tp_p, tp_rank=int(prefill["attn_tp_rank"]))
        dst = KVShardLayout(num_layers=1, num_heads=total, tp_size=tp_d, tp_rank=int(decode["attn_tp_rank"]))
    except GeometryError as exc:  # heads that neither split nor replicate evenly over a TP size; a rank outside it
        return f"{exc}: {both}", None
    if src.heads_per_partition != heads_p:
        return (f"the prefill holds {heads_p} KV heads, not the {src.heads_per_partition} that {total} heads over "
                f"attention TP {tp_p} give: {both}"), None
    if tp_d < tp_p and tp_p > total:
        return (f"a decode of fewer ranks than a prefill that replicates its {total} KV heads (attention TP {tp_p}) "
                f"would read each head from several ranks; refused as by vLLM's NixlConnector: {both}"), None
    if len(src_lens) != len(dst_lens):
        return f"{len(src_lens)} KV buffers on the prefill, {len(dst_lens)} on the decode: {both}", None
    heads_d = dst.heads_per_partition
    for i, (s, d) in enumerate(zip(src_lens, dst_lens)):
        head_bytes, rest = divmod(s, page * heads_p)
        if rest or not head_bytes or d != page * heads_d * head_bytes:
            return (f"KV buffer {i}: a prefill page of {s} B is {page} tokens x {heads_p} heads, so the decode's "
                    f"{heads_d} heads make {page * heads_d * (s // (page * heads_p))} B, but its page is {d} B: "
                    f"{both}"), None
    transfer = kv_transfer_between(src, dst)
    if transfer is None:
        return (f"prefill rank {src.tp_rank} holds heads {src.local_head_range()}, decode rank {dst.tp_rank} "
                f"{dst.local_head_range()}: nothing in common (SGLang paired them): {both}"), None
    s_head, d_head, n = transfer.src_head_offset, transfer.dst_head_offset, transfer.head_end - transfer.head_start
    if n == heads_p == heads_d:
        return None, PagePlan((None,) * len(src_lens), (s_head, d_head, n))
    parts = []
    for s in src_lens:
        hb = s // (page * heads_p)
        parts.append(tuple(SlicePart((t * heads_p + s_head) * hb, (t * heads_d + d_head) * hb, n * hb)
                           for t in range(page)))
    return None, PagePlan(tuple(parts), (s_head, d_head, n))


def _plan_stage(prefill: dict[str, Any], decode: dict[str, Any]) -> tuple[Optional[str], Optional[PagePlan]]:
    """A prefill pipeline stage into a decode of PP 1 (module docstring): whole pages, each stage buffer into
    the decode buffer of the same layer."""
    both = _both(prefill, decode)
    pp_p, pp_d = int(prefill.get("pp_size") or 1), int(decode.get("pp_size") or 1)
    if pp_d != 1:
        return (f"kvxfer reads pipeline stages into a decode of PP 1 only (one rank holding every layer), this "
                f"decode has PP {pp_d}: {both}"), None
    if int(prefill.get("attn_tp_size") or 0) != int(decode.get("attn_tp_size") or 0):
        return f"kvxfer reads pipeline stages at the same attention TP only (prefill PP {pp_p}): {both}", None
    diffs = _field_diffs(prefill, decode, PP_FIELDS)
    if diffs:
        return "; ".join(diffs), None
    if not prefill.get("mla") and prefill.get("attn_tp_rank") != decode.get("attn_tp_rank"):
        return (f"attn_tp_rank: prefill={prefill.get('attn_tp_rank')!r} decode={decode.get('attn_tp_rank')!r} (the "
                f"same TP size pairs equal ranks: they hold the same heads): {both}"), None
    if prefill.get("state_types"):
        return (f"kvxfer does not read state ({prefill['state_types']}) across pipeline stages (each stage holds its "
                f"own layers' state): {both}"), None
    if prefill.get("num_draft_entries"):
        return f"kvxfer does not map draft-model KV buffers across pipeline stages: {both}", None
    if prefill.get("kv_layout") is not None:
        return (f"kvxfer maps pipeline stages of SGLang's MHA/GQA and MLA pools only, not kv_layout="
                f"{prefill['kv_layout']!r}: {both}"), None
    stage, whole = prefill.get("layers"), decode.get("layers")
    if not stage or not whole:
        return f"a side states no layers: {both}", None
    start, stop = int(stage[0]), int(stage[1])
    total = int(whole[1]) - int(whole[0])
    stated = prefill.get("prefill_end_layer")
    if stated is not None and int(stated) != stop:
        return (f"the prefill stage's {stop - start} layers from prefill_start_layer={start} end at {stop}, but SGLang "
                f"states prefill_end_layer={stated}: {both}"), None
    if start < 0 or stop <= start or stop > total:
        return (f"the prefill stage's layers [{start}, {stop}) are not within the decode's {total} layers: "
                f"{both}"), None
    count = stop - start
    src_lens, dst_lens = [int(x) for x in prefill["kv_item_lens"]], [int(x) for x in decode["kv_item_lens"]]
    per_layer = 1 if prefill.get("mla") else 2  # MLA: one latent per layer; MHA/GQA: K layers, then V layers
    if len(src_lens) != per_layer * count or len(dst_lens) != per_layer * total:
        return (f"KV buffers: the prefill stage has {len(src_lens)} for {count} layers, the decode {len(dst_lens)} "
                f"for {total} ({per_layer} per layer expected): {both}"), None
    targets = tuple(start + i if i < count else total + start + (i - count) for i in range(len(src_lens)))
    for i, j in enumerate(targets):
        if src_lens[i] != dst_lens[j]:
            return (f"KV buffer {i} of the prefill stage (layer {start + i % count}) has pages of {src_lens[i]} B, the "
                    f"decode's buffer {j} of {dst_lens[j]} B: {both}"), None
    return None, PagePlan((None,) * len(src_lens), buffers=targets, layers=(start, stop))


def stage_coverage(plans: list[tuple[str, PagePlan]], decode: dict[str, Any]) -> Optional[str]:
    """Why the pipeline stages a room is read from (``(prefill rank, its plan)``) do not give every decode
    layer exactly once, or None (also when no plan is a stage's)."""
    staged = sorted((plan.layers, key) for key, plan in plans if plan.layers is not None)
    if not staged:
        return None
    if len(staged) != len(plans):
        return (f"the room is read from pipeline stages and from ranks that are none: "
                f"{sorted(key for key, plan in plans if plan.layers is None)}")
    whole = decode.get("layers") or [0, 0]
    at, total = int(whole[0]), int(whole[1])
    shown = ", ".join(f"{key} [{a}, {b})" for (a, b), key in staged)
    for (a, b), key in staged:
        if a != at:
            return (f"the prefill's pipeline stages give layers {shown}: "
                    f"{'layer ' + str(at) + ' is read from none' if a > at else 'layer ' + str(a) + ' twice'} "
                    f"(the decode holds layers [0, {total}))")
        at = b
    if at != total:
        return f"the prefill's pipeline stages give layers {shown}: layers [{at}, {total}) are read from none"
    return None


#: Why state other than Mamba's across attention TP sizes is refused, and what to do instead.
STATE_TP_WHY = ("kvxfer slices only Mamba state slots across attention TP sizes (as SGLang's own nixl does); other "
                "state kinds are copied whole: run both roles at the same attention TP")


def parallel_refusal(*, prefill_tp: int, prefill_pp: int, decode_tp: int, decode_pp: int,
                     decode_state: list[Any]) -> Optional[str]:
    """What kvxfer refuses at bootstrap, from SGLang's parallel info alone (before any layout is exchanged)."""
    if decode_pp != 1:
        return ("kvxfer reads into a decode of PP 1 only (each layer read from the prefill stage that holds it); a "
                "decode of PP > 1 is not supported")
    if prefill_pp != 1:
        if prefill_tp != decode_tp:
            return "kvxfer reads pipeline stages at the same attention TP only (PP combined with different TP)"
        if decode_state:
            return (f"kvxfer does not read state across pipeline stages (this decode's state: "
                    f"{[str(getattr(s, 'value', s)) for s in decode_state]})")
    if prefill_tp != decode_tp:
        if min(prefill_tp, decode_tp) < 1 or max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
            return "the attention TP sizes must divide one another"
        other = [str(getattr(s, "value", s)) for s in decode_state if str(getattr(s, "value", s)) != SLICED_STATE]
        if other:
            return (f"kvxfer does not slice state across attention TP sizes other than Mamba's (this decode's state: "
                    f"{[str(getattr(s, 'value', s)) for s in decode_state]}; {STATE_TP_WHY})")
    return None


#: SGLang's state kind whose slots kvxfer slices across attention TP sizes (``StateType.MAMBA``'s value).
SLICED_STATE = "mamba"
#: The most byte blocks one state tensor's slot is read in (rows x sub-blocks; SGLang's have 1-3 of each).
MAX_STATE_BLOCKS = 256


def plan_state(prefill: dict[str, Any], decode: dict[str, Any]) -> tuple[Optional[str], Optional[StatePlan]]:
    """Mamba state across attention TP sizes (docs/sglang.md, "Mamba state across attention TP"): per state
    tensor, the byte blocks of one slot this decode rank reads from this prefill rank. Each tensor's slot is
    ``outer`` rows of its TP-sharded axis (``state_dims``: that axis's size on the rank, as SGLang's
    ``setup_state_kv_args`` states it on both roles). One prefill rank feeding several decode ranks gives each its
    window of the axis; several prefill ranks feeding one decode rank each give their shard at its place. A conv
    state whose axis is several independently sharded sub-blocks (``state_conv_groups``, their full sizes: GDN's
    ``[q | k | v]``) is sliced sub-block by sub-block. Refused: state kinds other than Mamba, state replicated
    across the TP group (an axis of 0), axes and item lengths that do not split as the TP sizes say."""
    both = _both(prefill, decode)
    kinds = list(prefill.get("state_types") or [])
    if kinds != list(decode.get("state_types") or []):
        return f"state kinds differ: prefill={kinds} decode={decode.get('state_types')}: {both}", None
    if any(kind != SLICED_STATE for kind in kinds):
        return (f"kvxfer does not slice state ({kinds}) across attention TP sizes (only Mamba's): {both}"), None
    tp_p, tp_d = int(prefill["attn_tp_size"]), int(decode["attn_tp_size"])
    rank_p, rank_d = int(prefill["attn_tp_rank"]), int(decode["attn_tp_rank"])
    if prefill.get("mla") and tp_p > tp_d:
        return (f"an MLA prefill's ranks past the first are SGLang's dummy pairings for a decode of fewer ranks, "
                f"which hand nothing over: their shards of the Mamba state would not be read: {both}"), None
    plans = []
    for c, kind in enumerate(kinds):
        fields = [[list(side.get(key) or [])[c] if c < len(side.get(key) or []) else [] for side in (prefill, decode)]
                  for key in ("state_item_lens", "state_dims", "state_outer_counts", "state_conv_groups")]
        (src_lens, dst_lens), (src_dims, dst_dims), (outers, dst_outers), (groups, _) = fields
        counts = {len(src_lens), len(dst_lens), len(src_dims), len(dst_dims), len(outers)}
        if len(counts) != 1 or outers != dst_outers:
            return (f"{kind} state tensors do not pair (item lengths {src_lens} / {dst_lens}, sharded axes {src_dims} "
                    f"/ {dst_dims}, outer rows {outers} / {dst_outers}): {both}"), None
        tensors = []
        for j, (s_len, d_len, s_dim, d_dim, outer) in enumerate(zip(src_lens, dst_lens, src_dims, dst_dims, outers)):
            group = groups[j] if j < len(groups) else None
            blocks = _state_blocks(int(s_len), int(d_len), int(s_dim), int(d_dim), int(outer or 1), tp_p, tp_d,
                                   rank_p, rank_d, group)
            if isinstance(blocks, str):
                return f"{kind} state tensor {j}: {blocks}: {both}", None
            tensors.append(blocks)
        plans.append(tuple(tensors))
    return None, StatePlan(tuple(plans))


def _state_blocks(s_len: int, d_len: int, s_dim: int, d_dim: int, outer: int, tp_p: int, tp_d: int, rank_p: int,
                  rank_d: int, group: Optional[list[int]]) -> "tuple[SlicePart, ...] | str":
    """One state tensor's slot: the byte blocks (``SlicePart``) this decode rank reads from this prefill rank, or
    why not."""
    if outer < 1 or s_dim < 0 or d_dim < 0:
        return f"{outer} rows of a sharded axis of {s_dim} / {d_dim}"
    if not s_dim or not d_dim:
        return ("state replicated across the attention-TP group (a sharded axis of 0) is not read across TP sizes "
                "(SGLang's own nixl refuses it too)")
    if s_dim * tp_p != d_dim * tp_d:
        return f"a sharded axis of {s_dim} x TP {tp_p} on the prefill, {d_dim} x TP {tp_d} on the decode"
    unit, rest = divmod(s_len, s_dim * outer)
    if rest or not unit or d_len != d_dim * outer * unit:
        return (f"slots of {s_len} B (prefill) and {d_len} B (decode) are not {outer} row(s) of the sharded axis "
                f"({s_dim} / {d_dim}) of one element size")
    subs = [int(g) for g in group] if group else None
    if subs is not None and (sum(subs) != s_dim * tp_p or any(g <= 0 or g % tp_p or g % tp_d for g in subs)):
        subs = None  # sub-blocks that do not describe this axis: one contiguous block, as SGLang then sends it
    if subs is None:
        subs = [s_dim * tp_p]
    if outer * len(subs) > MAX_STATE_BLOCKS:  # a peer's layout must not cost this rank a plan of any size
        return f"{outer} rows x {len(subs)} sub-blocks make more than {MAX_STATE_BLOCKS} blocks per slot"
    axis = []  # (src start, dst start, count) along the sharded axis
    s_off = d_off = 0
    for full in subs:
        s_sub, d_sub = full // tp_p, full // tp_d
        if tp_p > tp_d:  # several prefill ranks into one decode rank: this one's shard at its place
            axis.append((s_off, d_off + (rank_p % (tp_p // tp_d)) * s_sub, s_sub))
        else:  # one prefill rank into several decode ranks: this decode rank's window
            axis.append((s_off + (rank_d * d_sub) % s_sub, d_off, d_sub))
        s_off, d_off = s_off + s_sub, d_off + d_sub
    return tuple(SlicePart(row * s_dim * unit + s * unit, row * d_dim * unit + d * unit, n * unit)
                 for row in range(outer) for s, d, n in axis)
