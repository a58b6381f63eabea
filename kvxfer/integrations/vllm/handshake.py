"""The handshake document a producer serves: its ranks' metas, layout and ticket key, sealed.

Built by the producer's scheduler from what each worker reported (``get_handshake_metadata``
-> ``set_xfer_handshake_metadata``), checked by the decode's worker before it trusts any
field (``parse_handshake``), and compared with the decode's own layout
(``check_compatible``): the same model (a hybrid model's KV cache groups included) and per-block
layout; a block size equal, or a prefill block that divides the decode's as NixlConnector allows it
(``block_sizes``); equal tensor parallelism or different TP on ``LBHNC`` (HND) as NixlConnector maps
it, and on ``LBNHC`` (NHD), which NixlConnector refuses, read by runs (``tp_reads``); MLA models
(``model["use_mla"]``: one latent cache per layer, the same on every TP rank) with any TP sizes
that divide one another, each decode rank reading whole blocks from one prefill rank; hybrid
attention+Mamba (Mamba2, Mamba1, GDN) models with different TP read by parts of their pages (``hybrid_tp``); else a
refusal that names both sides' layouts (for different TP sizes: NixlConnector's reason when
it refuses the pair too, ``tp_mapping``). The pools' lengths (``num_blocks``) may differ:
vLLM sizes each instance's pool by profiling; the decode checks every ticket's block ids
against the producer's ``num_blocks`` instead. Pure, apart from JSON.

A handshake is a peer's claim (without ``KVXFER_SECRET_FILE``, any process of this host can serve one),
so nothing in it may cost the decode time or memory in proportion to what it says (issue 39): every
number is bounded before any work (``MAX_*``, ``check_layout_bounds``), the compatibility check stops at
the first difference, and with several TP ranks each rank's metas must carry that rank, sealed in them
(the agent name its worker registered under: ``rank_agent_name``), so one rank's metas listed for
another are refused (round 5: TP 2 claimed with rank 0's metas twice loaded 3/3 blocks garbled). With
pipeline stages the name carries the stage too, so one stage's metas listed for another are refused.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

from kvxfer.errors import LayoutError, PeerMetadataError
from kvxfer.integrations.vllm.attn_format import TOKENS
from kvxfer.integrations.vllm.block_sizes import block_size_problem, masked_regions
from kvxfer.integrations.vllm.hybrid_tp import hybrid_tp_problem
from kvxfer.integrations.vllm.pp_stages import Stage, parse_stages, stage_problem, stage_region_slice
from kvxfer.integrations.vllm.tp_mapping import check_mla_pair, check_tp_pair, describe_side, plan_rank_reads
from kvxfer.meta.seal import HOST_FIELD, check_meta_seal, host_identity, seal_meta

#: 2: regions without the pool length, num_blocks apart; 3: a hybrid model's attention page facts
#: (``kv_layout``, ``kv_page``, ``kv_split``), Mamba type and group count, for different TP; 4: with
#: several TP ranks, each rank's metas name it (``rank_agent_name``); 5: a prefill of PP > 1 lists its
#: stages (``EngineLayout.stages``) and one rank entry per (stage, TP rank), stage-major (``pp_stages``), each
#: entry's metas naming its stage (``rank_agent_name``: at PP > 1 only, so PP 1 documents are as before, and an
#: older decode's rank check still reads these names)
HANDSHAKE_VERSION = 5

#: vLLM's layouts on which a decode rank reads a head range of a prefill rank's block (``tp_reads``).
TP_LAYOUTS = ("LBHNC", "LBNHC")
#: The most TP ranks a handshake may claim. Why: each rank's metas are listed and checked, and a decode
#: rank walks the prefill ranks it maps to (``tp_mapping.target_ranks``); vLLM runs TP sizes up to 64.
MAX_TP_SIZE = 1024
#: The most pipeline stages a handshake may claim (only compared with this decode's; bounded all the same).
MAX_PP_SIZE = 1024
#: The most KV heads a model may claim. Why: the TP mapping works per head range (``tp_mapping``); real
#: models have at most a few hundred (round 5 claimed 2**26: a 7-10 s engine step and +5.1 GiB). The
#: hybrid mapping's own bound on its units (``hybrid_tp.MAX_UNITS``) is the same.
MAX_KV_HEADS = 1 << 16
#: The most layers a model, a region or a KV cache group may claim (the largest models have ~100-200).
MAX_LAYERS = 1 << 14
#: The most KV regions a layout may list (at most one per layer: ``kv_buffers.kv_regions``); each rank
#: lists one meta per region.
MAX_REGIONS = MAX_LAYERS
#: The most KV cache groups a hybrid model may list (vLLM makes a handful).
MAX_KV_GROUPS = 256
#: The largest head size (elements) a model may claim.
MAX_HEAD_SIZE = 1 << 16
#: The largest block size (tokens) a layout may claim.
MAX_BLOCK_SIZE = 1 << 24
#: Any other number of the layout (page bytes, state shapes, pool length) must be below this: those are
#: only compared or multiplied by other bounded numbers, never enumerated.
MAX_NUMBER = 1 << 50
#: The layout document's shape: nesting depth, items of one list or object, strings, and nodes in all.
#: Why: it is walked (checked, compared, described in errors) whole; a model's facts are a few hundred nodes.
MAX_DEPTH = 8
MAX_ITEMS = MAX_LAYERS
MAX_STRING = 4096
MAX_NODES = 1 << 18
#: The longest engine id, instance, backend name or ticket key a handshake may carry (they are quoted in
#: errors and logs, and kept per producer).
MAX_ID = 256
#: How much of a peer's model facts an error message quotes (a refusal is logged per request).
QUOTE_CHARS = 600

_AGENT_RANK = re.compile(r"(?:-pp(?P<stage>\d{1,5})of(?P<pp>\d{1,5}))?"
                         r"-tp(?P<rank>\d{1,5})of(?P<size>\d{1,5})-[0-9a-f]{8}$")


def rank_agent_name(engine_id: str, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The agent name a vLLM worker registers under: its TP rank and size, and with PP > 1 its stage
    (``-pp{stage}of{pp}`` before the TP part), are in every meta it exports, sealed with it, which is how a
    handshake shows each rank entry's metas are that stage's and rank's (``parse_handshake``). At PP 1 the
    name is what it was before stages (``-tp{rank}of{tp}``): PP 1 handshakes are unchanged."""
    stage = f"-pp{pp_rank}of{pp_size}" if pp_size > 1 else ""
    return f"vllm-{engine_id[:24]}{stage}-tp{tp_rank}of{tp_size}-{uuid.uuid4().hex[:8]}"


def agent_rank(agent_name: Any) -> Optional[tuple[int, int]]:
    """``(tp_rank, tp_size)`` of a ``rank_agent_name``, else None."""
    m = _AGENT_RANK.search(agent_name) if isinstance(agent_name, str) else None
    return None if m is None else (int(m["rank"]), int(m["size"]))


def agent_stage(agent_name: Any) -> Optional[tuple[int, int]]:
    """``(pp_rank, pp_size)`` of a ``rank_agent_name``: ``(0, 1)`` for a name without a stage (PP 1), None
    for a name that is not one."""
    m = _AGENT_RANK.search(agent_name) if isinstance(agent_name, str) else None
    if m is None:
        return None
    return (0, 1) if m["stage"] is None else (int(m["stage"]), int(m["pp"]))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded_int(value: Any, name: str, low: int, high: int) -> int:
    if not _is_int(value) or not low <= value <= high:
        raise PeerMetadataError(f"handshake layout field {name!r} must be an int in [{low}, {high}], got "
                                f"{_quote(value, 40)}")
    return value


def _quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters (a peer's text in an error message)."""
    return _quote_text(repr(value), limit)


def _quote_text(text: str, limit: int = QUOTE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _check_shape(doc: Any) -> None:
    """The layout document is JSON of bounded shape (``MAX_DEPTH``, ``MAX_ITEMS``, ``MAX_STRING``,
    ``MAX_NODES``) and every number in it below ``MAX_NUMBER``: walked once, iteratively."""
    stack, nodes = [(doc, 0)], 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise PeerMetadataError(f"handshake layout has more than {MAX_NODES} values")
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            if not -MAX_NUMBER < value < MAX_NUMBER:
                raise PeerMetadataError(f"handshake layout holds the number {_quote(value, 40)}, over 2**50")
        elif isinstance(value, float):
            if not math.isfinite(value) or abs(value) >= MAX_NUMBER:
                raise PeerMetadataError(f"handshake layout holds the number {_quote(value, 40)}")
        elif isinstance(value, str):
            if len(value) > MAX_STRING:
                raise PeerMetadataError(f"handshake layout holds a string of {len(value)} characters "
                                        f"(at most {MAX_STRING})")
        elif isinstance(value, (list, tuple, Mapping)):
            if depth >= MAX_DEPTH:
                raise PeerMetadataError(f"handshake layout is nested deeper than {MAX_DEPTH}")
            if len(value) > MAX_ITEMS:
                raise PeerMetadataError(f"handshake layout has a list or object of {len(value)} items "
                                        f"(at most {MAX_ITEMS})")
            if isinstance(value, Mapping):
                if not all(isinstance(k, str) and len(k) <= MAX_STRING for k in value):
                    raise PeerMetadataError("handshake layout has an object key that is not a short string")
                stack.extend((v, depth + 1) for v in value.values())
            else:
                stack.extend((v, depth + 1) for v in value)
        else:
            raise PeerMetadataError(f"handshake layout holds a {type(value).__name__}, not JSON")


def check_layout_bounds(layout: "EngineLayout") -> None:
    """Every number of a layout that work is proportional to, within its ``MAX_*`` (``PeerMetadataError``
    naming the field): run on a peer's layout before anything else reads it."""
    model = layout.model
    _bounded_int(layout.tp_size, "tp_size", 1, MAX_TP_SIZE)
    _bounded_int(layout.pp_size, "pp_size", 1, MAX_PP_SIZE)
    _bounded_int(layout.block_size, "block_size", 1, MAX_BLOCK_SIZE)
    for name, high in (("num_kv_heads", MAX_KV_HEADS), ("num_layers", MAX_LAYERS), ("head_size", MAX_HEAD_SIZE),
                       ("mamba_ngroups", MAX_KV_HEADS)):
        if model.get(name) is not None:
            _bounded_int(model[name], f"model.{name}", 1, high)
    if len(layout.regions) > MAX_REGIONS:
        raise PeerMetadataError(f"handshake layout lists {len(layout.regions)} regions (at most {MAX_REGIONS})")
    for region in layout.regions:
        if region.get("layers") is not None:
            _bounded_int(region["layers"], "regions[].layers", 0, MAX_LAYERS)
        shape = region.get("layer_shape") or []
        if len(shape) > MAX_DEPTH or not all(n is None or (_is_int(n) and 0 <= n < MAX_NUMBER) for n in shape):
            raise PeerMetadataError(f"handshake layout field 'regions[].layer_shape' is not a short list of sizes: "
                                    f"{_quote(shape, 80)}")
    groups = model.get("kv_groups")
    if isinstance(groups, list):
        if len(groups) > MAX_KV_GROUPS:
            raise PeerMetadataError(f"handshake layout lists {len(groups)} KV cache groups (at most {MAX_KV_GROUPS})")
        for group in groups:
            if group.get("layers") is not None:
                _bounded_int(group["layers"], "model.kv_groups[].layers", 0, MAX_LAYERS)


@dataclass(frozen=True)
class EngineLayout:
    """One instance's KV layout as it matters for moving whole blocks."""

    model: Mapping[str, Any]  # name, dtype, layers, kv heads, head size
    tp_size: int
    pp_size: int
    block_size: int
    regions: tuple[Mapping[str, Any], ...]  # kv_buffers.layout_signature()["regions"]
    num_blocks: int = 0  # this instance's pool length: not compared, block ids are checked against it
    #: PP > 1: each stage's layer window and region count, its regions those of ``regions`` in stage order
    stages: tuple[Stage, ...] = ()

    def stage_regions(self, index: int) -> tuple[Mapping[str, Any], ...]:
        """The regions of stage ``index`` (all of them at PP 1)."""
        return self.regions[stage_region_slice(self.stages, index)] if self.stages else self.regions

    @property
    def num_rank_entries(self) -> int:
        """Rank entries a handshake lists: one per (stage, TP rank)."""
        return self.tp_size * max(1, len(self.stages))

    @property
    def is_mla(self) -> bool:
        """vLLM's ``model_config.use_mla``: each layer keeps one latent cache, identical on every TP
        rank (no heads to split), so any rank's block is the whole block."""
        return self.model.get("use_mla") is True

    def latent(self, any_block_size: bool = False) -> str:
        """One layer's latent block, as both sides must have it for an MLA read (``check_mla_pair``);
        ``any_block_size``: its tokens per block left out (``None``), for a pair of different block sizes."""
        regions = masked_regions(self, tokens=True) if any_block_size else self.regions
        shapes = sorted({str(tuple(r.get("layer_shape") or ())) for r in regions})
        dtypes = sorted({str(r.get("dtype")) for r in self.regions})
        layers = sum(int(r.get("layers") or 0) for r in self.regions)
        return f"MLA latent per layer {'/'.join(shapes)} {'/'.join(dtypes)} x {layers} layers"

    @property
    def is_hybrid(self) -> bool:
        """Several KV cache groups (attention + Mamba), registered as one allocation's pages."""
        return bool(self.model.get("kv_groups"))

    def describe(self) -> str:
        if self.is_hybrid:
            groups = "; ".join(
                f"{g.get('spec')} x {g.get('layers')} layers, block_size {g.get('block_size')}, page "
                f"{g.get('page_bytes')} B" + (f", state {g.get('shapes')} {g.get('dtypes')}, mamba_cache_mode "
                                              f"{g.get('mamba_cache_mode')}, conv layout {g.get('conv_layout')}"
                                              if "shapes" in g else "")
                for g in self.model["kv_groups"] if isinstance(g, Mapping))
            shapes = ", ".join(str(tuple(r.get("layer_shape", ()))) for r in self.regions) or "none"
            return (f"TP {self.tp_size} x PP {self.pp_size}, hybrid KV cache groups [{groups}] read as "
                    f"{layout_name(self)} {shapes} (layer slots, blocks, page bytes), {self.num_blocks} blocks")
        if self.is_mla:
            return (f"TP {self.tp_size} x PP {self.pp_size}, {self.latent()} (replicated on every TP rank), "
                    f"block_size {self.block_size}, {self.num_blocks} blocks")
        heads = self.model.get("num_kv_heads")
        per_rank = heads // self.tp_size if isinstance(heads, int) and self.tp_size else "?"
        shapes = ", ".join(str(tuple(r.get("layer_shape", ()))) for r in self.regions) or "none"
        return (f"TP {self.tp_size} x PP {self.pp_size}, {heads} KV heads ({per_rank} per rank), block_size "
                f"{self.block_size}, per-layer KV {shapes} {self.model.get('kv_dtype')}, {self.num_blocks} blocks")

    def to_dict(self) -> dict[str, Any]:
        doc = {"model": dict(self.model), "tp_size": self.tp_size, "pp_size": self.pp_size,
               "block_size": self.block_size, "regions": [dict(r) for r in self.regions],
               "num_blocks": self.num_blocks}
        if self.stages:
            doc["stages"] = [[s.first, s.layers, s.regions] for s in self.stages]
        return doc

    @classmethod
    def from_dict(cls, d: Any) -> "EngineLayout":
        if not isinstance(d, Mapping) or not isinstance(d.get("model"), Mapping) or not isinstance(d.get("regions"), list):
            raise PeerMetadataError("handshake field 'layout' is malformed")
        _check_shape(d)
        ints = {}
        for name in ("tp_size", "pp_size", "block_size", "num_blocks"):
            value = d.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 40:
                raise PeerMetadataError(f"handshake layout field {name!r} must be a positive int, got {value!r:.40}")
            ints[name] = value
        groups = d["model"].get("kv_groups")
        if groups is not None and not (isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups)):
            raise PeerMetadataError("handshake layout field 'model.kv_groups' must be a list of objects")
        if not all(isinstance(r, Mapping) and isinstance(r.get("layer_shape", []), list) for r in d["regions"]):
            raise PeerMetadataError("handshake layout field 'regions' must be objects with a 'layer_shape' list")
        layout = cls(model=dict(d["model"]), regions=tuple(d["regions"]), **ints)
        check_layout_bounds(layout)
        if d.get("stages") is not None:
            layout = replace(layout, stages=parse_stages(d.get("stages"), layout.pp_size, len(layout.regions)))
        return layout


@dataclass(frozen=True)
class Handshake:
    """A producer's checked handshake."""

    engine_id: str
    instance: str
    backend: str
    layout: EngineLayout
    rank_kv_metas: tuple[tuple[dict[str, Any], ...], ...]  # per rank entry (stage-major), one meta per its region
    rank_lease_metas: tuple[dict[str, Any], ...]
    ticket_key: Optional[bytes]  # only without a cluster secret


def build_handshake(*, engine_id: str, instance: str, backend: str, layout: EngineLayout,
                    ranks: Mapping[int, Mapping[str, Any]], ticket_key: Optional[bytes],
                    cluster_key: Optional[bytes]) -> bytes:
    """The sealed document (JSON bytes). ``ranks[tp_rank] = {"kv": [meta...], "lease": meta}``; with pipeline
    stages (``layout.stages``) keyed ``pp_rank * tp_size + tp_rank``, each with its stage's regions' metas."""
    entries = layout.num_rank_entries
    if sorted(ranks) != list(range(entries)):
        raise LayoutError(f"handshake metadata came from ranks {sorted(ranks)}, expected 0..{entries - 1} "
                          f"(TP {layout.tp_size} x {max(1, len(layout.stages))} stage(s))")
    doc: dict[str, Any] = {
        "kvxfer_vllm_handshake": HANDSHAKE_VERSION,
        "engine_id": engine_id,
        "instance": instance,
        "backend": backend,
        "layout": layout.to_dict(),
        "ranks": [{"kv": list(ranks[r]["kv"]), "lease": ranks[r]["lease"]} for r in range(entries)],
        HOST_FIELD: host_identity(),
    }
    if ticket_key is not None:
        doc["ticket_key"] = ticket_key.hex()
    return json.dumps(seal_meta(doc, cluster_key), separators=(",", ":")).encode()


def parse_handshake(doc: Any, cluster_key: Optional[bytes], *, allow_unauthenticated: bool = False) -> Handshake:
    """Check the seal (signature with a key; same host without) and every field."""
    sealed = check_meta_seal(doc, cluster_key, allow_unauthenticated=allow_unauthenticated)
    if sealed.get("kvxfer_vllm_handshake") != HANDSHAKE_VERSION:
        raise PeerMetadataError(f"handshake version {sealed.get('kvxfer_vllm_handshake')!r:.20}, this kvxfer speaks "
                                f"{HANDSHAKE_VERSION}: run the same kvxfer on both sides")
    for name in ("engine_id", "instance", "backend"):
        if not isinstance(sealed.get(name), str) or not 0 < len(sealed[name]) <= MAX_ID:
            raise PeerMetadataError(f"handshake field {name!r} must be a non-empty string of at most {MAX_ID} "
                                    "characters")
    layout = EngineLayout.from_dict(sealed.get("layout"))
    ranks = sealed.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != layout.num_rank_entries:
        raise PeerMetadataError(f"handshake field 'ranks' must list {layout.num_rank_entries} ranks (TP "
                                f"{layout.tp_size} x {max(1, len(layout.stages))} stage(s))")
    kv, lease = [], []
    for index, rank in enumerate(ranks):
        if not isinstance(rank, Mapping) or not isinstance(rank.get("kv"), list) or not isinstance(rank.get("lease"), dict):
            raise PeerMetadataError("handshake field 'ranks' is malformed")
        stage_regions = layout.stage_regions(index // layout.tp_size)
        if len(rank["kv"]) != len(stage_regions) or not all(isinstance(m, dict) for m in rank["kv"]):
            raise PeerMetadataError("handshake rank metas do not match its layout's regions")
        _check_rank_metas(index % layout.tp_size, layout.tp_size, [*rank["kv"], rank["lease"]],
                          index // layout.tp_size, len(layout.stages) or 1)
        kv.append(tuple(rank["kv"]))
        lease.append(rank["lease"])
    key = sealed.get("ticket_key")
    ticket_key = None
    if key is not None:
        if not isinstance(key, str) or len(key) > MAX_ID:
            raise PeerMetadataError("handshake field 'ticket_key' is not a short hex string")
        try:
            ticket_key = bytes.fromhex(key)
        except (TypeError, ValueError):
            raise PeerMetadataError("handshake field 'ticket_key' is not hex") from None
        if len(ticket_key) < 16:
            raise PeerMetadataError("handshake field 'ticket_key' is too short")
    return Handshake(sealed["engine_id"], sealed["instance"], sealed["backend"], layout, tuple(kv), tuple(lease),
                     ticket_key)


def _check_rank_metas(rank: int, tp_size: int, metas: list[dict[str, Any]], stage: int = 0,
                      pp_size: int = 1) -> None:
    """Rank entry (stage ``stage``, TP rank ``rank``)'s metas (its KV regions' and its lease's) were exported
    by that stage's TP rank ``rank`` of ``tp_size``: one agent, whose name (``rank_agent_name``, sealed in each
    meta) says so. Required with several ranks or stages; with one, a name that names a rank must name rank 0
    of 1 (and no stage, or stage 0 of 1)."""
    names = {meta.get("agent_name") if isinstance(meta.get("agent_name"), str) else None for meta in metas}
    one = next(iter(names)) if len(names) == 1 else None
    named, named_stage = agent_rank(one), agent_stage(one)
    if tp_size == 1 and pp_size == 1 and len(names) == 1 and named is None:
        return
    shown = ", ".join(_quote(n, 80) for n in sorted(names, key=str)[:3])
    if named != (rank, tp_size):
        where = f"stage {stage} of PP {pp_size}, " if pp_size > 1 else ""
        raise PeerMetadataError(
            f"handshake {where}rank {rank} of TP {tp_size}: its metas were exported by agent(s) {shown}, not by TP "
            f"rank {rank} of {tp_size} (a rank's metas carry its rank, sealed in them: metas of another rank, or "
            "duplicated, are refused)")
    if named_stage != (stage, pp_size):
        theirs = "no pipeline stage (PP 1)" if named_stage == (0, 1) else \
            f"pipeline stage {named_stage[0]} of {named_stage[1]}"  # type: ignore[index]
        raise PeerMetadataError(
            f"handshake stage {stage} of PP {pp_size}, rank {rank} of TP {tp_size}: its metas were exported by "
            f"agent {shown}, of {theirs}, not by stage {stage}'s TP rank {rank} (a rank's metas carry its stage, "
            "sealed in them: another stage's metas read as this stage's layers are refused)")


def layout_name(layout: EngineLayout) -> str:
    """vLLM's layout name as the regions' signature carries it (``LBHNC``: HND, ``LBNHC``: NHD)."""
    names = {str(r.get("layout", "?")) for r in layout.regions}
    return names.pop() if len(names) == 1 else "/".join(sorted(names)) or "?"


def tp_problem(prefill: EngineLayout, decode: EngineLayout) -> Optional[str]:
    """Why different TP sizes are refused, or None when they are read (``tp_reads``): NixlConnector's
    reason when it refuses the pair too (``tp_mapping.check_tp_pair``), and any layout but ``LBHNC``
    on both sides, the one where a block's heads are contiguous slabs (``kv_buffers``)."""
    if prefill.is_hybrid or decode.is_hybrid:
        return hybrid_tp_problem(prefill, decode)  # parts of its pages (``hybrid_tp``)
    if prefill.is_mla or decode.is_mla:
        return _mla_tp_problem(prefill, decode)
    heads = prefill.model.get("num_kv_heads")
    if not isinstance(heads, int) or isinstance(heads, bool):
        return "tensor parallelism (no KV head count to map it with)"
    src_layout, dst_layout = layout_name(prefill), layout_name(decode)
    try:
        check_tp_pair(src_tp=prefill.tp_size, dst_tp=decode.tp_size, total_kv_heads=heads,
                      src_layout=src_layout, dst_layout=dst_layout,
                      src_block_size=prefill.block_size, dst_block_size=decode.block_size)
        plan_rank_reads(dst_rank=0, dst_tp=decode.tp_size, src_tp=prefill.tp_size, total_kv_heads=heads)
    except LayoutError as exc:
        return f"tensor parallelism, refused as NixlConnector refuses it ({exc})"
    sides = (f"prefill {describe_side('prefill', prefill.tp_size, heads, src_layout, prefill.block_size)}; "
             f"decode {describe_side('decode', decode.tp_size, heads, dst_layout, decode.block_size)}")
    if src_layout not in TP_LAYOUTS:
        return (f"tensor parallelism on layout {src_layout}: KvxferConnector reads a head range only on LBHNC "
                f"(HND: a head's tokens are one slab) or LBNHC (NHD: one run per token) ({sides})")
    resized = prefill.block_size != decode.block_size  # ``block_size_problem`` decides on that
    if src_layout == "LBNHC" and decode.model.get("kv_format", TOKENS) != TOKENS:
        return (f"tensor parallelism on LBNHC with the attention kernel's packing {decode.model.get('kv_format')!r}: "
                f"a head's bytes in a token are known here only for {TOKENS!r} ({sides})")
    if masked_regions(prefill, heads=True, tokens=resized) != masked_regions(decode, heads=True, tokens=resized):
        return f"per-layer KV layout beyond the heads ({sides})"
    for lay in (prefill, decode):
        per_rank = max(1, heads // lay.tp_size)
        if any((r.get("layer_shape") or [None, None])[1] != per_rank for r in lay.regions):
            return f"KV heads per rank: TP {lay.tp_size} with {heads} KV heads should hold {per_rank} ({sides})"
    return None


def _mla_tp_problem(prefill: EngineLayout, decode: EngineLayout) -> Optional[str]:
    """MLA with different TP: read whole latent blocks from one prefill rank (``tp_mapping.mla_source_rank``),
    if both sides are MLA with the same latent blocks, as NixlConnector requires of a replicated cache."""
    if not (prefill.is_mla and decode.is_mla):
        return (f"attention type: MLA on one side only (prefill use_mla={prefill.is_mla}, decode "
                f"use_mla={decode.is_mla})")
    try:
        resized = prefill.block_size != decode.block_size  # ``block_size_problem`` decides on that
        check_mla_pair(src_tp=prefill.tp_size, dst_tp=decode.tp_size, src_latent=prefill.latent(resized),
                       dst_latent=decode.latent(resized), src_block_size=prefill.block_size,
                       dst_block_size=decode.block_size)
    except LayoutError as exc:
        return f"tensor parallelism, refused as NixlConnector refuses it ({exc})"
    if masked_regions(prefill, tokens=resized) != masked_regions(decode, tokens=resized):
        return f"MLA per-layer KV layout (prefill {prefill.latent()}; decode {decode.latent()})"
    return None


def _same_hybrid_model(prefill: EngineLayout, decode: EngineLayout) -> bool:
    """Both hybrid with different TP sizes, the same model but for the KV cache groups, whose per-rank
    shares differ with the TP size and are compared by ``hybrid_tp_problem``."""
    drop = lambda model: {k: v for k, v in model.items() if k != "kv_groups"}  # noqa: E731
    return (prefill.is_hybrid and decode.is_hybrid and prefill.tp_size != decode.tp_size
            and drop(prefill.model) == drop(decode.model))


def first_difference(theirs: EngineLayout, local: EngineLayout) -> Optional[str]:
    """What first keeps whole blocks from being read byte for byte, or None: checked in order (model,
    pipeline parallelism, tensor parallelism, block size, per-layer layout), and stopped at the first
    difference, so nothing about a peer's TP (``tp_problem``) is worked out for a pair refused already."""
    if theirs.model != local.model and not _same_hybrid_model(theirs, local):
        return _model_difference(theirs.model, local.model)
    if theirs.stages:  # a prefill's stages into a decode of PP 1 (``pp_stages``: the whole check, TP, block size
        # and per-layer layout included)
        return stage_problem(theirs, local)
    if theirs.pp_size != local.pp_size:
        return "pipeline parallelism"
    if theirs.tp_size != local.tp_size:
        problem = tp_problem(theirs, local)
        if problem is not None:
            return problem
    problem = block_size_problem(theirs, local, layout_name(local))
    if problem is not None:
        return problem
    resized = theirs.block_size != local.block_size  # a prefill block read into part of a decode block
    if theirs.tp_size == local.tp_size and \
            masked_regions(theirs, tokens=resized) != masked_regions(local, tokens=resized):
        return "per-layer KV layout"
    return None


def _model_difference(theirs: Mapping[str, Any], local: Mapping[str, Any]) -> str:
    """"model facts" and the first few that differ, each side's value quoted short."""
    absent = object()
    keys = [k for k in sorted(set(theirs) | set(local)) if theirs.get(k, absent) != local.get(k, absent)]
    if len(keys) > 1 and "kv_groups" in keys:  # a hybrid model's groups differ with the TP size: the others first
        keys.remove("kv_groups")
        keys.append("kv_groups")
    shown = "; ".join(f"{k}: prefill {_quote(theirs[k], 80) if k in theirs else 'absent'}, decode "
                      f"{_quote(local[k], 80) if k in local else 'absent'}" for k in keys[:3])
    return f"model facts ({shown}{'; ...' if len(keys) > 3 else ''})"


def check_compatible(local: EngineLayout, local_backend: str, remote: Handshake) -> None:
    """``LayoutError`` naming both layouts and the first difference, unless whole blocks can be read byte for byte."""
    if remote.backend != local_backend:
        raise LayoutError(f"prefill engine {remote.engine_id!r} moves KV with kvxfer backend {remote.backend!r}, this "
                          f"decode with {local_backend!r}: set the same kv_connector_extra_config 'backend' on both")
    theirs = remote.layout
    problem = first_difference(theirs, local)
    if problem is not None:
        raise LayoutError(
            f"prefill engine {remote.engine_id!r} cannot hand KV to this decode: different {problem}. "
            f"prefill: {_quote_text(theirs.describe())} (model {_quote(dict(theirs.model))}); decode: "
            f"{local.describe()} (model {dict(local.model)}). Run both with the same model, dtype, "
            "tensor_parallel_size and block_size"
        )
