"""The handshake document a producer serves: its ranks' metas, layout and ticket key, sealed.

Built by the producer's scheduler from what each worker reported (``get_handshake_metadata``
-> ``set_xfer_handshake_metadata``), checked by the decode's worker before it trusts any
field (``parse_handshake``), and compared with the decode's own layout
(``check_compatible``): the same block size, model (a hybrid model's KV cache groups included) and
per-block layout, and equal tensor
parallelism or different TP on ``LBHNC`` as NixlConnector maps it (``tp_reads``); MLA models
(``model["use_mla"]``: one latent cache per layer, the same on every TP rank) with any TP sizes
that divide one another, each decode rank reading whole blocks from one prefill rank; hybrid
attention+Mamba (Mamba2, Mamba1, GDN) models with different TP read by parts of their pages (``hybrid_tp``); else a
refusal that names both sides' layouts (for different TP sizes: NixlConnector's reason when
it refuses the pair too, ``tp_mapping``). The pools' lengths (``num_blocks``) may differ:
vLLM sizes each instance's pool by profiling; the decode checks every ticket's block ids
against the producer's ``num_blocks`` instead. Pure, apart from JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from kvxfer.errors import LayoutError, PeerMetadataError
from kvxfer.integrations.vllm.hybrid_tp import hybrid_tp_problem
from kvxfer.integrations.vllm.tp_mapping import check_mla_pair, check_tp_pair, describe_side, plan_rank_reads
from kvxfer.meta.seal import HOST_FIELD, check_meta_seal, host_identity, seal_meta

#: 2: regions without the pool length, num_blocks apart; 3: a hybrid model's attention page facts
#: (``kv_layout``, ``kv_page``, ``kv_split``), Mamba type and group count, for different TP
HANDSHAKE_VERSION = 3


@dataclass(frozen=True)
class EngineLayout:
    """One instance's KV layout as it matters for moving whole blocks."""

    model: Mapping[str, Any]  # name, dtype, layers, kv heads, head size
    tp_size: int
    pp_size: int
    block_size: int
    regions: tuple[Mapping[str, Any], ...]  # kv_buffers.layout_signature()["regions"]
    num_blocks: int = 0  # this instance's pool length: not compared, block ids are checked against it

    @property
    def is_mla(self) -> bool:
        """vLLM's ``model_config.use_mla``: each layer keeps one latent cache, identical on every TP
        rank (no heads to split), so any rank's block is the whole block."""
        return self.model.get("use_mla") is True

    def latent(self) -> str:
        """One layer's latent block, as both sides must have it for an MLA read (``check_mla_pair``)."""
        shapes = sorted({str(tuple(r.get("layer_shape") or ())) for r in self.regions})
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
        return {"model": dict(self.model), "tp_size": self.tp_size, "pp_size": self.pp_size,
                "block_size": self.block_size, "regions": [dict(r) for r in self.regions],
                "num_blocks": self.num_blocks}

    @classmethod
    def from_dict(cls, d: Any) -> "EngineLayout":
        if not isinstance(d, Mapping) or not isinstance(d.get("model"), Mapping) or not isinstance(d.get("regions"), list):
            raise PeerMetadataError("handshake field 'layout' is malformed")
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
        return cls(model=dict(d["model"]), regions=tuple(d["regions"]), **ints)


@dataclass(frozen=True)
class Handshake:
    """A producer's checked handshake."""

    engine_id: str
    instance: str
    backend: str
    layout: EngineLayout
    rank_kv_metas: tuple[tuple[dict[str, Any], ...], ...]  # per TP rank, one meta per KV region
    rank_lease_metas: tuple[dict[str, Any], ...]
    ticket_key: Optional[bytes]  # only without a cluster secret


def build_handshake(*, engine_id: str, instance: str, backend: str, layout: EngineLayout,
                    ranks: Mapping[int, Mapping[str, Any]], ticket_key: Optional[bytes],
                    cluster_key: Optional[bytes]) -> bytes:
    """The sealed document (JSON bytes). ``ranks[tp_rank] = {"kv": [meta...], "lease": meta}``."""
    if sorted(ranks) != list(range(layout.tp_size)):
        raise LayoutError(f"handshake metadata came from TP ranks {sorted(ranks)}, expected 0..{layout.tp_size - 1}")
    doc: dict[str, Any] = {
        "kvxfer_vllm_handshake": HANDSHAKE_VERSION,
        "engine_id": engine_id,
        "instance": instance,
        "backend": backend,
        "layout": layout.to_dict(),
        "ranks": [{"kv": list(ranks[r]["kv"]), "lease": ranks[r]["lease"]} for r in range(layout.tp_size)],
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
        if not isinstance(sealed.get(name), str) or not sealed[name]:
            raise PeerMetadataError(f"handshake field {name!r} must be a non-empty string")
    layout = EngineLayout.from_dict(sealed.get("layout"))
    ranks = sealed.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != layout.tp_size:
        raise PeerMetadataError(f"handshake field 'ranks' must list {layout.tp_size} TP ranks")
    kv, lease = [], []
    for rank in ranks:
        if not isinstance(rank, Mapping) or not isinstance(rank.get("kv"), list) or not isinstance(rank.get("lease"), dict):
            raise PeerMetadataError("handshake field 'ranks' is malformed")
        if len(rank["kv"]) != len(layout.regions) or not all(isinstance(m, dict) for m in rank["kv"]):
            raise PeerMetadataError("handshake rank metas do not match its layout's regions")
        kv.append(tuple(rank["kv"]))
        lease.append(rank["lease"])
    key = sealed.get("ticket_key")
    ticket_key = None
    if key is not None:
        try:
            ticket_key = bytes.fromhex(key)
        except (TypeError, ValueError):
            raise PeerMetadataError("handshake field 'ticket_key' is not hex") from None
        if len(ticket_key) < 16:
            raise PeerMetadataError("handshake field 'ticket_key' is too short")
    return Handshake(sealed["engine_id"], sealed["instance"], sealed["backend"], layout, tuple(kv), tuple(lease),
                     ticket_key)


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
    if src_layout != "LBHNC":
        return (f"tensor parallelism on layout {src_layout}: KvxferConnector reads a head range only on LBHNC "
                f"(HND), where a block's heads are contiguous ({sides})")
    if _masked(prefill) != _masked(decode):
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
        check_mla_pair(src_tp=prefill.tp_size, dst_tp=decode.tp_size, src_latent=prefill.latent(),
                       dst_latent=decode.latent(), src_block_size=prefill.block_size,
                       dst_block_size=decode.block_size)
    except LayoutError as exc:
        return f"tensor parallelism, refused as NixlConnector refuses it ({exc})"
    if [dict(r) for r in prefill.regions] != [dict(r) for r in decode.regions]:
        return f"MLA per-layer KV layout (prefill {prefill.latent()}; decode {decode.latent()})"
    return None


def _same_hybrid_model(prefill: EngineLayout, decode: EngineLayout) -> bool:
    """Both hybrid with different TP sizes, the same model but for the KV cache groups, whose per-rank
    shares differ with the TP size and are compared by ``hybrid_tp_problem``."""
    drop = lambda model: {k: v for k, v in model.items() if k != "kv_groups"}  # noqa: E731
    return (prefill.is_hybrid and decode.is_hybrid and prefill.tp_size != decode.tp_size
            and drop(prefill.model) == drop(decode.model))


def _masked(layout: EngineLayout) -> list[dict]:
    """The regions' signatures without the heads per rank, which differ with the TP size."""
    out = []
    for region in layout.regions:
        shape = list(region.get("layer_shape") or [])
        out.append({**dict(region), "layer_shape": shape[:1] + [None] + shape[2:]})
    return out


def check_compatible(local: EngineLayout, local_backend: str, remote: Handshake) -> None:
    """``LayoutError`` naming both layouts unless whole blocks can be read byte for byte."""
    if remote.backend != local_backend:
        raise LayoutError(f"prefill engine {remote.engine_id!r} moves KV with kvxfer backend {remote.backend!r}, this "
                          f"decode with {local_backend!r}: set the same kv_connector_extra_config 'backend' on both")
    theirs = remote.layout
    problems = []
    if theirs.model != local.model and not _same_hybrid_model(theirs, local):
        problems.append("model")
    if theirs.pp_size != local.pp_size:
        problems.append("pipeline parallelism")
    if theirs.tp_size != local.tp_size:
        problem = tp_problem(theirs, local)
        if problem is not None:
            problems.append(problem)
    if theirs.block_size != local.block_size:
        problems.append("block_size")
    if not problems and theirs.tp_size == local.tp_size and \
            [dict(r) for r in theirs.regions] != [dict(r) for r in local.regions]:
        problems.append("per-layer KV layout")
    if (theirs.is_mla or local.is_mla) and theirs.latent() != local.latent() and theirs.tp_size == local.tp_size:
        problems.append(f"MLA latent cache (prefill {theirs.latent()}; decode {local.latent()})")
    if problems:
        raise LayoutError(
            f"prefill engine {remote.engine_id!r} cannot hand KV to this decode: different {', '.join(problems)}. "
            f"prefill: {theirs.describe()} (model {dict(theirs.model)}); decode: {local.describe()} "
            f"(model {dict(local.model)}). Run both with the same model, dtype, tensor_parallel_size and block_size"
        )
