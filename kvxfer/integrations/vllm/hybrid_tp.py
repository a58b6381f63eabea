"""Different TP for a hybrid attention+Mamba model: which bytes of which prefill page each decode page needs.

A hybrid model's KV cache is one allocation of pages (``kv_buffers.hma_pages_region``), and with
different TP sizes a prefill page and a decode page hold different shares of the same state, so a
decode page is filled from *parts* of prefill pages (``kvxfer.plan.parts``). The facts, read from
vLLM 0.32 (``v1/kv_cache_interface.py``, ``model_executor/layers/mamba/mamba_utils.py``
``MambaStateShapeCalculator``, and NixlConnector's ``ssm_conv_transfer_utils.py``, which does the
same with its conv transfer for the same three state types):

* an attention page on ``LBHNC`` (HND) is ``[kv_heads_local, block_size, 2 * head_size]``: a head
  range is one byte range, read as for a plain attention model (``tp_mapping.plan_rank_reads``,
  GQA dedup and replication included);
* a Mamba page is the conv state, then the SSM (temporal) state (then padding to the common page
  size). The conv state's channels are *bands*, each split by TP in units of a fixed width:

  - Mamba2: ``[x | B | C]``, ``x`` of ``nheads_local * head_dim`` channels split by SSM heads, ``B``
    and ``C`` of ``ngroups_local * d_state`` split by groups (replicated on ``TP / ngroups`` ranks
    when TP exceeds the groups, as KV heads are: ``extra_groups_for_head_shards``); the SSM state
    ``(nheads_local, head_dim, d_state)``;
  - Mamba1: ``[x]``, the ``intermediate_local`` channels; the SSM state ``(intermediate_local, d_state)``;
  - GDN (gated delta net): ``[Q | K | V]``, ``Q`` and ``K`` of ``num_k_heads_local * head_k_dim``,
    ``V`` of ``num_v_heads_local * head_v_dim``; the SSM state ``(num_v_heads_local, head_v_dim,
    head_k_dim)``;

  and the SSM state splits along its first dimension. ``DS`` conv layout is ``(channels, rows)``,
  so a channel range is one byte range; ``SD``, vLLM's default, is ``(rows, channels)``: one byte
  range per row;
* each band is mapped like KV heads: ``plan_rank_reads`` with the band's unit count, so every
  decode rank reads each unit once, from the prefill rank vLLM's mapping names, and tells every
  prefill rank it maps to that it is done.

Refused at the handshake, naming both sides: other state types (short conv, linear attention,
...), more state tensors than conv + SSM, attention not ``LBHNC``, MLA, TP sizes or unit counts
that do not split evenly, and any difference in what the pages mean beyond their TP share.
Pure: no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kvxfer.errors import KVXferError, LayoutError
from kvxfer.integrations.vllm.tp_mapping import check_tp_pair, plan_rank_reads, target_ranks
from kvxfer.integrations.vllm.specs import ATTENTION, MAMBA
from kvxfer.plan.parts import SlicePart

#: vLLM's ``MambaAttentionBackendEnum`` members whose state is mapped across TP sizes.
MAMBA1, MAMBA2, GDN = "MAMBA1", "MAMBA2", "GDN_ATTN"
#: Most KV heads, SSM heads, groups, conv channels or rows a peer's facts may claim (the parts of a
#: page are built per unit range and per conv row: a forged count must not make that list huge).
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
class Band:
    """A run of conv channels that TP splits: ``units`` (whole model: SSM heads, groups, channels,
    K or V heads) of ``width`` channels each."""

    units: int
    width: int


@dataclass(frozen=True)
class _Side:
    """One instance's hybrid page facts, per rank."""

    tp: int
    slots: int
    page: int
    kv_heads: int
    head_bytes: int  # one KV head of one attention block
    mamba_type: str
    bands: tuple[Band, ...]  # the conv state's channels, in order
    ssm_units: int  # whole model; the SSM state splits along its first dimension
    ssm_unit_bytes: int
    rows: int
    conv_layout: str
    conv_elem: int
    ssm_elem: int

    def local(self, band: Band) -> int:
        """A rank's units of ``band`` (one, replicated, when TP exceeds them: Mamba2's groups)."""
        return max(1, band.units // self.tp)

    def band_start(self, index: int) -> int:
        """The first channel of band ``index`` in a rank's conv state."""
        return sum(self.local(b) * b.width for b in self.bands[:index])

    @property
    def conv_channels(self) -> int:
        return self.band_start(len(self.bands))

    @property
    def conv_bytes(self) -> int:
        return self.conv_channels * self.rows * self.conv_elem

    @property
    def ssm_bytes(self) -> int:
        return self.ssm_units // self.tp * self.ssm_unit_bytes

    def shares(self) -> tuple:
        """What must be equal on both sides of a pair: everything but the TP size and the page size."""
        return (self.slots, self.head_bytes, self.mamba_type, self.bands, self.ssm_units, self.ssm_unit_bytes,
                self.rows, self.conv_layout, self.conv_elem, self.ssm_elem)


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
    if len(types) != 1 or not types <= {MAMBA1, MAMBA2, GDN}:
        raise LayoutError(f"{role}: Mamba state of type {sorted(types)}; only Mamba1's, Mamba2's and GDN's conv "
                          "bands and heads are mapped across TP sizes")
    facts = {(str(g.get("shapes")), str(g.get("dtypes")), str(g.get("conv_layout"))) for g in mamba}
    if len(facts) != 1:
        raise LayoutError(f"{role}: Mamba groups with different state shapes {sorted(facts)}")
    spec, mamba_type = mamba[0], types.pop()
    shapes, dtypes, conv_layout = spec.get("shapes"), spec.get("dtypes"), str(spec.get("conv_layout"))
    ssm_dims = 2 if mamba_type == MAMBA1 else 3
    if not (isinstance(shapes, list) and len(shapes) == 2 and isinstance(dtypes, list) and len(dtypes) == 2
            and isinstance(shapes[0], list) and len(shapes[0]) == 2 and isinstance(shapes[1], list)
            and len(shapes[1]) == ssm_dims and conv_layout in ("DS", "SD")):
        raise LayoutError(f"{role}: Mamba state {shapes} {dtypes} conv layout {conv_layout}; expected a conv state "
                          f"and a {ssm_dims}-dimensional SSM state ({mamba_type}), conv layout DS or SD")
    conv, ssm = shapes
    if not all(_count(n) for n in (*conv, *ssm)):
        raise LayoutError(f"{role}: Mamba state shapes {shapes} are not positive sizes")
    channels, rows = (conv[0], conv[1]) if conv_layout == "DS" else (conv[1], conv[0])
    kv_heads, head_size, tp = model.get("num_kv_heads"), model.get("head_size"), layout.tp_size
    if not all(_count(n) for n in (kv_heads, head_size)):
        raise LayoutError(f"{role}: the model's KV heads or head size is unknown")
    if max(kv_heads, channels, ssm[0] * tp, rows) > MAX_UNITS:
        raise LayoutError(f"{role}: more than {MAX_UNITS} heads, groups, conv channels or rows")
    kv_dtypes = {str(g.get("dtype")) for g in attention}
    if len(kv_dtypes) != 1:
        raise LayoutError(f"{role}: attention groups of dtypes {sorted(kv_dtypes)}")
    # one head of one block must be one run of tokens x (K and V): what the views showed, not assumed
    entry = 2 * head_size * _elem(kv_dtypes.pop())
    want = [max(1, kv_heads // tp), layout.block_size, entry]
    pages = [g.get("kv_page") for g in attention]
    if any(g.get("kv_split") != 1 for g in attention) or any(page != want for page in pages):
        raise LayoutError(f"{role}: attention pages {pages} (kernel block split "
                          f"{[g.get('kv_split') for g in attention]}); a head range is one byte range only in "
                          f"unsplit pages of [heads {want[0]}, tokens {want[1]}, K+V {want[2]} B]")
    bands, ssm_units, ssm_unit = _state_bands(mamba_type, channels, ssm, model, tp, role)
    if max(ssm_units, *(b.units for b in bands)) > MAX_UNITS:
        raise LayoutError(f"{role}: more than {MAX_UNITS} heads, groups, conv channels or rows")
    side = _Side(tp=tp, slots=shape[0], page=shape[2], kv_heads=kv_heads, head_bytes=layout.block_size * entry,
                 mamba_type=mamba_type, bands=bands, ssm_units=ssm_units,
                 ssm_unit_bytes=ssm_unit * _elem(dtypes[1]), rows=rows, conv_layout=conv_layout,
                 conv_elem=_elem(dtypes[0]), ssm_elem=_elem(dtypes[1]))
    attention_bytes = max(1, kv_heads // tp) * side.head_bytes
    if max(attention_bytes, side.conv_bytes + side.ssm_bytes) > side.page:
        raise LayoutError(f"{role}: a page of {side.page} B cannot hold its attention block or Mamba state")
    return side


def _state_bands(mamba_type: str, channels: int, ssm: list[int], model: Mapping[str, Any], tp: int,
                 role: str) -> tuple[tuple[Band, ...], int, int]:
    """A rank's conv channels as bands, the SSM state's units (whole model) and the elements of one unit,
    from the per-rank shapes vLLM reports (``MambaStateShapeCalculator``), or ``LayoutError``."""
    if mamba_type == MAMBA1:  # conv [x], SSM (intermediate, d_state): one channel per unit
        intermediate, d_state = ssm
        if channels != intermediate:
            raise LayoutError(f"{role}: a Mamba1 conv state of {channels} channels per rank is not its SSM state's "
                              f"{intermediate} (intermediate_size / TP)")
        return (Band(intermediate * tp, 1),), intermediate * tp, d_state
    if mamba_type == GDN:  # conv [Q | K | V], SSM (v heads, head_v_dim, head_k_dim)
        v_heads, v_dim, k_dim = ssm
        keys = channels - v_heads * v_dim
        if keys <= 0 or keys % (2 * k_dim):
            raise LayoutError(f"{role}: a GDN conv state of {channels} channels per rank is not Q + K (key heads x "
                              f"{k_dim}) + V ({v_heads} heads x {v_dim})")
        k_heads = keys // (2 * k_dim)
        return ((Band(k_heads * tp, k_dim), Band(k_heads * tp, k_dim), Band(v_heads * tp, v_dim)),
                v_heads * tp, v_dim * k_dim)
    heads_local, head_dim, d_state = ssm  # Mamba2: conv [x | B | C], SSM (heads, head_dim, d_state)
    ngroups = model.get("mamba_ngroups")
    if not _count(ngroups) or ngroups > MAX_UNITS:
        raise LayoutError(f"{role}: the model's Mamba group count is unknown")
    if (tp <= ngroups and ngroups % tp) or (tp > ngroups and tp % ngroups):
        raise LayoutError(f"{role}: TP {tp} does not split or replicate {ngroups} Mamba groups evenly")
    groups_local = max(1, ngroups // tp)
    if heads_local * head_dim + 2 * groups_local * d_state != channels:
        raise LayoutError(f"{role}: a conv state of {channels} channels per rank is not x ({heads_local} heads x "
                          f"{head_dim}) + B + C ({groups_local} groups x {d_state} each)")
    return ((Band(heads_local * tp, head_dim), Band(ngroups, d_state), Band(ngroups, d_state)),
            heads_local * tp, head_dim * d_state)


def describe(side: _Side) -> str:
    bands = " | ".join(f"{b.units} x {b.width}" for b in side.bands)
    return (f"TP {side.tp}: {side.kv_heads} KV heads, {side.mamba_type} conv [{bands}] {side.conv_layout} "
            f"{side.rows} rows, SSM {side.ssm_units} x {side.ssm_unit_bytes} B, pages {side.slots} x {side.page} B")


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
    if src.shares() != dst.shares():
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
    for index, band in enumerate(src.bands):
        src_start, dst_start, width = src.band_start(index), dst.band_start(index), band.width
        _band(reads, MAMBA, dst_rank, src, dst, band.units, lambda s, d, n, src_start=src_start, dst_start=dst_start,
              width=width: _conv_parts(src, dst, src_start + s * width, dst_start + d * width, n * width))
    unit = src.ssm_unit_bytes
    _band(reads, MAMBA, dst_rank, src, dst, src.ssm_units,
          lambda s, d, n: [SlicePart(src.conv_bytes + s * unit, dst.conv_bytes + d * unit, n * unit)])
    order = target_ranks(dst_rank, dst.tp, src.tp)
    return tuple(PageRead(rank, tuple((kind, tuple(parts)) for kind, parts in sorted(reads[rank].items())))
                 for rank in order if rank in reads)
