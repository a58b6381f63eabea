"""Different TP for a hybrid attention+Mamba model: which bytes of which prefill page each decode page needs.

A hybrid model's KV cache is one allocation of pages (``kv_buffers.hma_pages_region``), and with
different TP sizes a prefill page and a decode page hold different shares of the same state, so a
decode page is filled from *parts* of prefill pages (``kvxfer.plan.parts``). The facts, read from
vLLM 0.32 (``v1/kv_cache_interface.py``, ``model_executor/layers/mamba/mamba_utils.py``, and
NixlConnector's ``ssm_conv_transfer_utils.py``, which does the same with its "3-read" conv transfer):

* an attention page on ``LBHNC`` (HND) is ``[kv_heads_local, block_size, 2 * head_size]``: a head
  range is one byte range, read as for a plain attention model (``tp_mapping.plan_rank_reads``,
  GQA dedup and replication included);
* a Mamba2 page is the conv state, then the SSM state (then padding to the common page size).
  The conv state's channels are three bands ``[x | B | C]``, ``x`` of ``nheads_local * head_dim``
  channels split by SSM heads, ``B`` and ``C`` of ``ngroups_local * d_state`` channels split by
  groups (replicated on ``TP / ngroups`` ranks when TP exceeds the groups, as KV heads are:
  ``extra_groups_for_head_shards``). ``DS`` conv layout is ``(channels, rows)``, so a channel range
  is one byte range; ``SD``, vLLM's default, is ``(rows, channels)``: one byte range per row.
  The SSM state ``(nheads_local, head_dim, d_state)`` splits by heads;
* each band is mapped like KV heads: ``plan_rank_reads`` with the band's unit count (KV heads,
  SSM heads, groups), so every decode rank reads each unit once, from the prefill rank vLLM's
  mapping names, and tells every prefill rank it maps to that it is done.

Refused at the handshake, naming both sides: anything but Mamba2 state (Mamba1, GDN), more state
tensors than conv + SSM, attention not ``LBHNC``, MLA, TP sizes or unit counts that do not split
evenly, and any difference in what the pages mean beyond their TP share. Pure: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kvxfer.errors import KVXferError, LayoutError
from kvxfer.integrations.vllm.tp_mapping import check_tp_pair, plan_rank_reads, target_ranks
from kvxfer.integrations.vllm.specs import ATTENTION, MAMBA
from kvxfer.plan.parts import SlicePart

#: vLLM's ``MambaAttentionBackendEnum`` member whose conv state is the three bands x, B, C.
MAMBA2 = "MAMBA2"
#: Most KV heads, SSM heads, groups or conv rows a peer's facts may claim (the parts of a page are
#: built per unit range and per conv row: a forged count must not make that list huge).
MAX_UNITS = 1 << 16


@dataclass(frozen=True)
class PageRead:
    """What decode rank reads from prefill rank ``src_rank``: for each KV cache group kind, the parts
    of every page of that group (``begin_pull_blocks(..., parts=)``)."""

    src_rank: int
    parts: tuple[tuple[str, tuple[SlicePart, ...]], ...]

    def parts_for(self, kind: str) -> tuple[SlicePart, ...]:
        return next((parts for k, parts in self.parts if k == kind), ())


@dataclass(frozen=True)
class _Side:
    """One instance's hybrid page facts, per rank."""

    tp: int
    slots: int
    page: int
    kv_heads: int
    head_bytes: int  # one KV head of one attention block
    nheads: int  # SSM heads, whole model
    head_dim: int
    d_state: int
    ngroups: int
    rows: int
    conv_layout: str
    conv_elem: int
    ssm_elem: int

    @property
    def heads_local(self) -> int:
        return self.nheads // self.tp

    @property
    def groups_local(self) -> int:
        return max(1, self.ngroups // self.tp)

    @property
    def conv_channels(self) -> int:
        return self.heads_local * self.head_dim + 2 * self.groups_local * self.d_state

    @property
    def conv_bytes(self) -> int:
        return self.conv_channels * self.rows * self.conv_elem


def _elem(dtype: Any) -> int:
    from kvxfer.plan.geometry import dtype_from_name

    return dtype_from_name(str(dtype)).itemsize


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 40


def _groups(layout: Any) -> list[Mapping[str, Any]]:
    groups = layout.model.get("kv_groups")
    return [g for g in groups if isinstance(g, Mapping)] if isinstance(groups, list) else []


def _side(layout: Any, role: str) -> _Side:
    """The page facts of one side, or ``LayoutError`` naming what cannot be read by parts."""
    groups = _groups(layout)
    attention = [g for g in groups if "shapes" not in g]
    mamba = [g for g in groups if "shapes" in g]
    model = layout.model
    if layout.is_mla:
        raise LayoutError(f"{role}: MLA in a hybrid model (no heads to split)")
    if len(layout.regions) != 1 or str(layout.regions[0].get("layout")) != "HMA-pages":
        raise LayoutError(f"{role}: not one HMA-pages region")
    shape = layout.regions[0].get("layer_shape")
    if not isinstance(shape, list) or len(shape) != 3 or not all(_count(n) for n in (shape[0], shape[2])):
        raise LayoutError(f"{role}: pages of shape {shape}")
    layouts = {str(g.get("kv_layout")) for g in attention}
    if layouts != {"LBHNC"}:
        raise LayoutError(f"{role}: attention layout {sorted(layouts)}; a head range is one byte range only on LBHNC")
    types = {str(g.get("mamba_type")) for g in mamba}
    if types != {MAMBA2}:
        raise LayoutError(f"{role}: Mamba state of type {sorted(types)}; only Mamba2's conv bands (x, B, C) and "
                          "heads are mapped across TP sizes")
    facts = {(str(g.get("shapes")), str(g.get("dtypes")), str(g.get("conv_layout"))) for g in mamba}
    if len(facts) != 1:
        raise LayoutError(f"{role}: Mamba groups with different state shapes {sorted(facts)}")
    spec = mamba[0]
    shapes, dtypes, conv_layout = spec.get("shapes"), spec.get("dtypes"), str(spec.get("conv_layout"))
    if not (isinstance(shapes, list) and len(shapes) == 2 and isinstance(dtypes, list) and len(dtypes) == 2
            and isinstance(shapes[0], list) and len(shapes[0]) == 2 and isinstance(shapes[1], list)
            and len(shapes[1]) == 3 and conv_layout in ("DS", "SD")):
        raise LayoutError(f"{role}: Mamba state {shapes} {dtypes} conv layout {conv_layout}; expected a conv state "
                          "and an SSM state (Mamba2), conv layout DS or SD")
    conv, ssm = shapes
    if not all(_count(n) for n in (*conv, *ssm)):
        raise LayoutError(f"{role}: Mamba state shapes {shapes} are not positive sizes")
    channels, rows = (conv[0], conv[1]) if conv_layout == "DS" else (conv[1], conv[0])
    heads_local, head_dim, d_state = ssm
    ngroups, kv_heads, head_size = model.get("mamba_ngroups"), model.get("num_kv_heads"), model.get("head_size")
    if not all(_count(n) for n in (ngroups, kv_heads, head_size)):
        raise LayoutError(f"{role}: the model's Mamba group count, KV heads or head size is unknown")
    if max(ngroups, kv_heads, heads_local * layout.tp_size, rows) > MAX_UNITS:
        raise LayoutError(f"{role}: more than {MAX_UNITS} heads, groups or conv rows")
    kv_dtypes = {str(g.get("dtype")) for g in attention}
    if len(kv_dtypes) != 1:
        raise LayoutError(f"{role}: attention groups of dtypes {sorted(kv_dtypes)}")
    # one head of one block must be one run of tokens x (K and V): what the views showed, not assumed
    entry = 2 * head_size * _elem(kv_dtypes.pop())
    want = [max(1, kv_heads // layout.tp_size), layout.block_size, entry]
    pages = [g.get("kv_page") for g in attention]
    if any(g.get("kv_split") != 1 for g in attention) or any(page != want for page in pages):
        raise LayoutError(f"{role}: attention pages {pages} (kernel block split "
                          f"{[g.get('kv_split') for g in attention]}); a head range is one byte range only in "
                          f"unsplit pages of [heads {want[0]}, tokens {want[1]}, K+V {want[2]} B]")
    side = _Side(tp=layout.tp_size, slots=shape[0], page=shape[2], kv_heads=kv_heads,
                 head_bytes=layout.block_size * entry,
                 nheads=heads_local * layout.tp_size, head_dim=head_dim, d_state=d_state, ngroups=ngroups,
                 rows=rows, conv_layout=conv_layout, conv_elem=_elem(dtypes[0]), ssm_elem=_elem(dtypes[1]))
    tp = layout.tp_size
    if (tp <= ngroups and ngroups % tp) or (tp > ngroups and tp % ngroups):
        raise LayoutError(f"{role}: TP {tp} does not split or replicate {ngroups} Mamba groups evenly")
    if side.conv_channels != channels:
        raise LayoutError(f"{role}: a conv state of {channels} channels per rank is not x ({heads_local} heads x "
                          f"{head_dim}) + B + C ({side.groups_local} groups x {d_state} each)")
    attention_bytes = max(1, kv_heads // tp) * side.head_bytes
    if max(attention_bytes, side.conv_bytes + heads_local * head_dim * d_state * side.ssm_elem) > side.page:
        raise LayoutError(f"{role}: a page of {side.page} B cannot hold its attention block or Mamba state")
    return side


def describe(side: _Side) -> str:
    return (f"TP {side.tp}: {side.kv_heads} KV heads, Mamba2 {side.nheads} heads x {side.head_dim} x {side.d_state}, "
            f"{side.ngroups} groups, conv {side.conv_layout} {side.rows} rows, pages {side.slots} x {side.page} B")


def _group_facts(layout: Any) -> list[dict[str, Any]]:
    """Each group's facts that do not depend on the TP size (shapes and page sizes do)."""
    return [{k: v for k, v in g.items() if k not in ("shapes", "page_bytes", "kv_page")} for g in _groups(layout)]


def hybrid_tp_problem(prefill: Any, decode: Any) -> Optional[str]:
    """Why a hybrid pair with different TP cannot be read by parts, or None (then ``page_reads``)."""
    small, large = sorted((prefill.tp_size, decode.tp_size))
    if large % small:
        return (f"tensor parallelism with a hybrid attention+Mamba model: TP sizes {prefill.tp_size} (prefill) and "
                f"{decode.tp_size} (decode) do not divide one another")
    try:
        src, dst = _side(prefill, "prefill"), _side(decode, "decode")
    except KVXferError as exc:  # LayoutError, or a dtype name that is none (PeerMetadataError)
        return (f"tensor parallelism with a hybrid attention+Mamba model ({exc}; prefill TP {prefill.tp_size}, "
                f"decode TP {decode.tp_size})")
    sides = f"prefill {describe(src)}; decode {describe(dst)}"
    if _group_facts(prefill) != _group_facts(decode):
        return f"hybrid KV cache groups beyond their TP share ({sides})"
    if (src.slots, src.head_bytes, src.nheads, src.head_dim, src.d_state, src.ngroups, src.rows, src.conv_layout,
            src.conv_elem, src.ssm_elem) != (dst.slots, dst.head_bytes, dst.nheads, dst.head_dim, dst.d_state,
                                             dst.ngroups, dst.rows, dst.conv_layout, dst.conv_elem, dst.ssm_elem):
        return f"hybrid pages beyond their TP share ({sides})"
    try:
        check_tp_pair(src_tp=src.tp, dst_tp=dst.tp, total_kv_heads=src.kv_heads, src_layout="LBHNC",
                      dst_layout="LBHNC", src_block_size=prefill.block_size, dst_block_size=decode.block_size)
        page_reads(0, prefill, decode)
    except LayoutError as exc:
        return f"tensor parallelism, refused as NixlConnector refuses it ({exc})"
    return None


def _band(reads: dict[int, dict[str, list[SlicePart]]], kind: str, dst_rank: int, src: _Side, dst: _Side,
          units: int, parts_of: Any) -> None:
    """Map one band of ``units`` (KV heads, SSM heads or groups) like KV heads, as parts per source rank."""
    plan = plan_rank_reads(dst_rank=dst_rank, dst_tp=dst.tp, src_tp=src.tp, total_kv_heads=units)
    for read in plan.reads:
        reads.setdefault(read.src_rank, {}).setdefault(kind, []).extend(
            parts_of(read.src_head, read.dst_head, read.num_heads))


def _conv_parts(src: _Side, dst: _Side, src_channel: int, dst_channel: int, channels: int) -> list[SlicePart]:
    """Channels ``src_channel..+channels`` of the source conv state into ``dst_channel..``: one part (DS),
    or one per row (SD)."""
    es = src.conv_elem
    if src.conv_layout == "DS":
        return [SlicePart(src_channel * src.rows * es, dst_channel * dst.rows * es, channels * src.rows * es)]
    return [SlicePart((row * src.conv_channels + src_channel) * es, (row * dst.conv_channels + dst_channel) * es,
                      channels * es) for row in range(src.rows)]


def page_reads(dst_rank: int, prefill: Any, decode: Any) -> tuple[PageRead, ...]:
    """Decode rank ``dst_rank``'s parts of each prefill rank's pages (``LayoutError`` if they do not tile)."""
    src, dst = _side(prefill, "prefill"), _side(decode, "decode")
    reads: dict[int, dict[str, list[SlicePart]]] = {}
    hb = src.head_bytes
    _band(reads, ATTENTION, dst_rank, src, dst, src.kv_heads,
          lambda s, d, n: [SlicePart(s * hb, d * hb, n * hb)])
    hd, ds = src.head_dim, src.d_state
    _band(reads, MAMBA, dst_rank, src, dst, src.nheads,
          lambda s, d, n: _conv_parts(src, dst, s * hd, d * hd, n * hd))
    for band in range(2):  # B, then C
        _band(reads, MAMBA, dst_rank, src, dst, src.ngroups, lambda s, d, n, band=band: _conv_parts(
            src, dst, src.heads_local * hd + band * src.groups_local * ds + s * ds,
            dst.heads_local * hd + band * dst.groups_local * ds + d * ds, n * ds))
    state = hd * ds * src.ssm_elem
    _band(reads, MAMBA, dst_rank, src, dst, src.nheads,
          lambda s, d, n: [SlicePart(src.conv_bytes + s * state, dst.conv_bytes + d * state, n * state)])
    order = target_ranks(dst_rank, dst.tp, src.tp)
    return tuple(PageRead(rank, tuple((kind, tuple(parts)) for kind, parts in sorted(reads[rank].items())))
                 for rank in order if rank in reads)

